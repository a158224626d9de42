"""Verification: structure (checker, shape inference, ORT session) and numerics against references.

Levels: ``off`` (nothing), ``structure`` (full ONNX checker incl. strict shape inference, opset and
domain imports, an ORT CPU session), ``numeric`` (structure + outputs on feeds compared with a
reference, mask-aware).

Ops with no CPU kernel (``com.microsoft::PackedMultiHeadAttention``, emitted for ``--provider cuda``)
are run on CPU through exact standard-op stand-ins (``graphopt.runtime.standins``): the model itself gets
the structure checks, a copy with the stand-ins gets the session and the numbers, and the verdict
names the ops so replaced (``Verdict.stand_ins``). Nodes with fp16/bf16 tensors and no CPU kernel in
that type (``convert-precision``) run in fp32 between Casts, reported as ``OP(float16)``. The CUDA
kernels themselves are checked on a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from graphopt import io
from graphopt.data import feeds as feeds_mod
from graphopt.data.metrics import Budget, Comparer, Comparison, compare, parse_budget
from graphopt.data.outputs import OutputStore
from graphopt.errors import RuntimeSetupError, UsageError, VerificationError, first_line
from graphopt.generate import float_view, quality
from graphopt.runtime import session as runtime

LEVELS = ("off", "structure", "numeric")


def check_level(level: str) -> str:
    if level not in LEVELS:
        raise UsageError(f"unknown verification level {level!r}", hint="use off, structure or numeric")
    return level


def check_structure(model: ir.Model | onnx.ModelProto | str, where: str = "model", *,
                    serialized: bytes | None = None) -> None:
    """Full ONNX checker (with strict shape inference) plus domain-import checks.

    ``model`` may be a path (models over 2 GB); ``serialized``, the proto's bytes when the caller
    has them already. Raises VerificationError naming what is wrong.
    """
    if isinstance(model, ir.Model):
        with io.materialize(model) as m:
            return check_structure(m, where)
    if isinstance(model, str):
        _check_domains(onnx.load(model, load_external_data=False), where)
        target: onnx.ModelProto | str | bytes = model
    else:
        _check_domains(model, where)
        target = model if serialized is None else serialized
    try:
        onnx.checker.check_model(target, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise VerificationError(f"{where}: ONNX checker failed: {first_line(e)}") from None


def _check_domains(proto: onnx.ModelProto, where: str) -> None:
    imported = {o.domain or "" for o in proto.opset_import}
    local_funcs = {(f.domain, f.name) for f in proto.functions}

    def walk(graph: onnx.GraphProto):
        for n in graph.node:
            d = n.domain or ""
            if d not in imported and (n.domain, n.op_type) not in local_funcs:
                raise VerificationError(
                    f"{where}: node {n.op_type} {n.name!r} uses domain {d or 'ai.onnx'!r} with no opset import"
                )
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                elif a.type == onnx.AttributeProto.GRAPHS:
                    for g in a.graphs:
                        walk(g)

    walk(proto.graph)


@dataclasses.dataclass
class Verdict:
    """Outcome of verifying one model against a reference."""

    level: str
    ok: bool
    comparison: Comparison | None = None
    reason: str = ""
    outputs: OutputStore | None = None  # per-feed outputs (list-like; see graphopt.data.outputs)
    #: CUDA-only op types that ran as their CPU stand-ins (graphopt.runtime.standins), not as themselves
    stand_ins: list[str] = dataclasses.field(default_factory=list)
    #: outputs on the edge feeds (graphopt.data.feeds.edge), when there were any; and how they compared:
    #: ``{"feeds": n, "max_abs": worst, "failed": [labels]}``
    edge_outputs: OutputStore | None = None
    edge: dict = dataclasses.field(default_factory=dict)

    def numbers(self) -> dict:
        return self.comparison.summary() if self.comparison is not None else {}


def run_model(
    model: ir.Model | onnx.ModelProto | str | Path | bytes,
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    provider: str = "cpu",
    optimize: bool = False,
) -> OutputStore:
    """Outputs of ``model`` on each feed, from an ORT session (optimizations off by default).

    The result is list-like (``result[i]`` is feed ``i``'s ``{output: array}``) and holds at most
    ``graphopt.data.outputs.MEMORY_BYTES`` in memory, the rest in a temp folder, so its memory does not
    grow with the number of feeds. An ``onnx_ir`` model with CUDA-only ops runs through their
    stand-ins where CUDA is not used.
    """
    return run_session(float_view.float_io(_session(model, provider, optimize), model), feeds)


def _session(model, provider: str, optimize: bool = False):
    if isinstance(model, ir.Model):
        try:
            model, _ = runtime.runnable(model, provider)
        except ValueError as e:
            raise RuntimeSetupError(f"cannot run the model on CPU: {e}") from None
    # a large model reaches ORT as a file whose weights ORT memory-maps: no packed copy of them beside
    return runtime.make_session(model, provider=provider, optimize=optimize, prepack=not _streamed(model))


def _streamed(model) -> bool:
    """Whether ``model`` reaches ORT as a file path (a large model, see ``graphopt.io.materialize``)."""
    return isinstance(model, (str, os.PathLike)) or (isinstance(model, ir.Model) and io.streams(model))


def run_session(sess, feeds: Sequence[Mapping[str, np.ndarray]], comparer: Comparer | None = None,
                reference: Sequence[Mapping[str, np.ndarray]] | None = None, *, keep: bool = True) -> OutputStore:
    """Outputs of an ORT session on each feed, kept in an OutputStore (spilled past its memory budget).

    With ``comparer``, each feed's outputs are folded into it against ``reference[i]`` as they come;
    ``keep=False`` then keeps none of them (the store comes back empty).
    """
    import onnxruntime as ort

    outs = OutputStore()
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()} | {i.name for i in sess.get_overridable_initializers()}
    # give the arena back after each run: with feeds of many shapes it would otherwise keep growing
    opts = ort.RunOptions()
    opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    for i, feed in enumerate(feeds):
        try:
            out = dict(zip(names, sess.run(names, {k: v for k, v in feed.items() if k in wanted}, opts)))
        except Exception as e:
            raise RuntimeSetupError(f"ONNX Runtime failed running the model: {first_line(e)}") from e
        if comparer is not None:
            comparer.add(out, reference[i], feed)
        if keep:
            outs.append(out)
        del out
    return outs


def verify(
    model: ir.Model,
    *,
    level: str,
    feeds: Sequence[Mapping[str, np.ndarray]] = (),
    reference: Sequence[Mapping[str, np.ndarray]] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    budget: Budget | None = None,
    provider: str = "cpu",
    where: str = "model",
    decoder=None,
    edge_feeds: Sequence[Mapping[str, np.ndarray]] = (),
    edge_reference: Sequence[Mapping[str, np.ndarray]] | None = None,
    edge_labels: Sequence[str] = (),
    scale_atol: bool = False,
) -> Verdict:
    """Verify ``model`` at ``level``; numerics compare against ``reference`` outputs.

    With a non-empty ``budget`` the budget decides (lossy passes); otherwise every element must be
    within ``atol + rtol*|ref|`` (lossless passes; ``scale_atol``: ``atol * max(1, largest |ref| of the output)``,
    what a decoder's logits get). ``decoder`` (a ``graphopt.generate.quality.DecoderCheck``)
    adds the decoder metrics measured on its held-back text to the comparison (budgets with ``ppl_ratio`` /
    ``greedy_match``). Never raises for a failed check: the verdict says.

    ``edge_feeds`` (``graphopt.data.feeds.edge``, named by ``edge_labels``) run in the same session; against
    ``edge_reference`` each must hold on its own, within ``atol * max(1, largest |ref|) + rtol*|ref|``
    (their magnitudes are extreme: rounding grows with them) and with no NaN or Inf the reference
    lacks. Their numbers go to ``Verdict.edge``, not into ``comparison``.
    """
    check_level(level)
    if level == "off":
        return Verdict(level, True)
    try:
        run_as, stand_ins = runtime.runnable(model, provider)
        if stand_ins:  # the model itself gets the structure checks, the copy with stand-ins the rest
            check_structure(model, where)
    except VerificationError as e:
        return Verdict(level, False, reason=e.message)
    except ValueError as e:
        return Verdict(level, False, reason=f"{where}: no CPU stand-in: {e}")
    with io.materialize(run_as) as proto:
        verdict = _verify_materialized(proto, level, feeds, reference, atol, rtol, budget, provider, where,
                                       _Edge(list(edge_feeds), edge_reference, list(edge_labels)), decoder, scale_atol)
    verdict.stand_ins = stand_ins
    return verdict


@dataclasses.dataclass
class _Edge:
    feeds: list
    reference: Sequence[Mapping[str, np.ndarray]] | None
    labels: list[str]


def _verify_materialized(proto, level, feeds, reference, atol, rtol, budget, provider, where,
                         edge: _Edge | None = None, decoder=None, scale_atol: bool = False) -> Verdict:
    # serialize once for both the checker and ORT (a 90 MB model costs ~0.1 s a copy)
    data = proto.SerializeToString() if isinstance(proto, onnx.ModelProto) else None
    try:
        check_structure(proto, where, serialized=data)
    except VerificationError as e:
        return Verdict(level, False, reason=e.message)
    if level == "structure":
        try:
            runtime.make_session(data if data is not None else proto, provider=provider, optimize=False,
                                 prepack=data is not None)
        except RuntimeSetupError as e:
            return Verdict(level, False, reason=f"{where}: {e.message}")
        return Verdict(level, True)
    if reference is not None and len(reference) != len(feeds):
        raise ValueError(f"{len(feeds)} feeds against {len(reference)} references")
    # feed by feed: each feed's outputs are compared as they come, then kept only in the store
    comparer = Comparer(atol=atol, rtol=rtol, scale_atol=scale_atol) if reference is not None else None
    try:
        sess = _session(data if data is not None else proto, provider)
        # a graph holding its KV cache quantized is fed and read with float past / present (float_view)
        outs = run_session(float_view.float_io(sess, proto), feeds, comparer, reference)
    except RuntimeSetupError as e:
        return Verdict(level, False, reason=f"{where}: {e.message}")
    edge_outs, edge_summary, edge_fails = _run_edge(sess, edge, atol, rtol)
    if comparer is None:
        return Verdict(level, True, outputs=outs, edge_outputs=edge_outs, edge=edge_summary)
    cmp = comparer.result()
    if decoder is not None:
        cmp.decoder.update(decoder.measure(sess, quality.HELD))
    del sess
    if budget:
        fails = budget.failures(cmp)
        ok = not fails
        reason = "; ".join(fails)
    else:
        ok = cmp.within(atol, rtol)
        reason = "" if ok else _describe_mismatch(cmp, atol, rtol, scale_atol)
    if ok and any(d.shape_mismatch for d in cmp.outputs.values()):
        ok = False
        reason = "; ".join(f"output {d.name!r}: {d.shape_mismatch}" for d in cmp.outputs.values() if d.shape_mismatch)
    if ok and edge_fails:
        ok, reason = False, "; ".join(edge_fails)
    return Verdict(level, ok, comparison=cmp, reason=reason if not ok else "", outputs=outs,
                   edge_outputs=edge_outs, edge=edge_summary)


def _run_edge(sess, edge: _Edge | None, atol: float, rtol: float) -> tuple[OutputStore | None, dict, list[str]]:
    """Outputs on the edge feeds, their summary and the failures (each feed compared on its own)."""
    if edge is None or not edge.feeds:
        return None, {}, []
    outs, fails, failed, worst = OutputStore(), [], [], 0.0
    for i, feed in enumerate(edge.feeds):
        label = edge.labels[i] if i < len(edge.labels) else f"#{i}"
        comparer = Comparer(atol=atol, rtol=rtol, scale_atol=True) if edge.reference is not None else None
        try:
            got = run_session(sess, [feed], comparer, None if comparer is None else [edge.reference[i]])
        except RuntimeSetupError as e:
            fails.append(f"edge feed {label!r}: {e.message}")
            failed.append(label)
            continue
        outs.append(got[0])
        if comparer is None:
            continue
        cmp = comparer.result()
        worst = max(worst, cmp.worst("max_abs"))
        bad = cmp.nonfinite() + [f"output {d.name!r}: {d.shape_mismatch}" for d in cmp.outputs.values()
                                 if d.shape_mismatch]
        if not bad and not cmp.within(atol, rtol):
            d = cmp.worst_output("max_abs")
            bad = [f"output {d.name!r}: max_abs {d.max_abs:.3g} (tolerance {atol:g}*max(1,|ref|max) + {rtol:g}*|ref|)"]
        fails.extend(f"edge feed {label!r}: {b}" for b in bad)
        failed.extend([label] if bad else [])
    summary = {"feeds": len(edge.feeds)}
    if edge.reference is not None:
        summary.update(max_abs=worst, failed=failed)
    return outs, summary, fails


def _describe_mismatch(cmp: Comparison, atol: float, rtol: float, scale_atol: bool = False) -> str:
    scaled = "*max(1,|ref|max)" if scale_atol else ""
    parts = cmp.nonfinite()
    for d in cmp.outputs.values():
        if d.shape_mismatch:
            parts.append(f"output {d.name!r}: {d.shape_mismatch}")
        elif d.mismatch:
            parts.append(
                f"output {d.name!r}: max_abs {d.max_abs:.3g} (tolerance {atol:g}{scaled} + {rtol:g}*|ref|), "
                f"{100 * d.mismatch:.2f}% of elements off, cosine min {d.cosine_min:.6f}"
            )
    return "; ".join(parts)


@dataclasses.dataclass
class ModelComparison:
    """Outputs of a candidate model against a reference model's on the same feeds."""

    comparison: Comparison
    feeds: list[dict[str, np.ndarray]]
    budget: Budget
    #: why the candidate fails (budget terms, tolerance, outputs missing from it); empty when it passes
    failures: list[str]
    #: the text rows the decoder metrics were measured on ("" when none were)
    text: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict:
        return {"ok": self.ok, "failures": self.failures, "budget": str(self.budget),
                "feeds": feeds_mod.describe(self.feeds), **({"text": self.text} if self.text else {}),
                **self.comparison.as_dict()}


def compare_models(
    reference: ir.Model | str | Path,
    candidate: ir.Model | str | Path,
    *,
    feeds: Sequence[Mapping[str, np.ndarray]] | None = None,
    calib: str | Path | None = None,
    budget: Budget | str | Sequence[str] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    provider: str = "cpu",
    shapes: Mapping[str, Sequence[int]] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
    text: str | Path | None = None,
    tokenizer: str | Path | None = None,
    text_window: int = 64,
) -> ModelComparison:
    """Run ``reference`` and ``candidate`` (models or paths) on the same feeds and compare their
    outputs mask-aware (``graphopt verify A B``).

    Feeds (``graphopt.data.feeds.select``): ``calib`` folder's (checked against the reference's inputs),
    else ``feeds``, else generated to make the reference run (``shapes`` / ``values`` fix inputs). With a non-empty ``budget`` the budget decides;
    otherwise every element must be within ``atol + rtol*|ref|``. Outputs of the reference that the
    candidate lacks are failures. Raises GraphoptError for unreadable models, bad feeds or budgets.

    Decoder metrics in the budget (``ppl_ratio``, ``greedy_match``) are measured on the held-back windows of
    ``text`` (a file; None: the default held-out text) cut into windows of ``text_window`` tokens, tokenized by ``tokenizer`` or the tokenizer beside
    ``reference`` (``graphopt.generate.quality``): the same rows ``optimize`` confirms a budget on.
    """
    if not isinstance(budget, Budget):
        budget = parse_budget(budget)
    a = reference if isinstance(reference, ir.Model) else io.load(reference)
    b = candidate if isinstance(candidate, ir.Model) else io.load(candidate)
    # generated feeds make A run (A's outputs on them come along, on CPU)
    selection = feeds_mod.select(a, feeds=feeds, calib=calib, shapes=shapes, values=values)
    feeds, out_a = selection.feeds, selection.outputs
    if out_a is None or provider != "cpu":
        out_a = run_model(a, feeds, provider=provider)
    out_b = run_model(b, feeds, provider=provider)
    names_a = list(out_a[0]) if out_a else []
    shared = [n for n in names_a if n in out_b[0]]
    cmp = compare(out_b, out_a, feeds, atol=atol, rtol=rtol, outputs=shared)
    text_rows = ""
    if budget.decoder:
        ref_path = reference if not isinstance(reference, ir.Model) else None
        check = quality.decoder_check(runtime.make_session(a, threads=1), model_path=ref_path, text=text,
                                      tokenizer=tokenizer, window=text_window)
        cmp.decoder.update(check.measure(runtime.make_session(b, threads=1), quality.HELD))
        text_rows = check.rows.describe()
    if budget:
        failures = budget.failures(cmp)
    else:
        failures = [] if cmp.within(atol, rtol) else [f"outputs differ beyond atol {atol:g} + rtol {rtol:g}*|ref|"]
    missing = [n for n in names_a if n not in shared]
    if missing:
        failures.append("outputs missing from B: " + ", ".join(missing))
    return ModelComparison(cmp, feeds, budget, failures, text_rows)
