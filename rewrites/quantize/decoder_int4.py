"""``quantize-int4``: a decoder's fp32 weight MatMuls to 4-bit ``MatMulNBits`` under a perplexity / greedy budget.

::

    x ──MatMul(W const float32 [K, N])──▶ y      ==>   x ──MatMulNBits(q, scales[, zero_points]; K, N, bits=4,
                                                                 block_size, accuracy_level)──▶ y
    ids ──Gather(E const [V, H])──▶ h            ==>   ids ──GatherBlockQuantized(q, ids, scales[, zp])──▶ h
                                                        (``embedding``, when the budget holds)

The kernel is chosen by measuring, on this CPU, in this process: every (``block_sizes`` x ``accuracy_levels``)
candidate with the projections quantized is built, and its decode step (batch 1, 1 thread) is timed
round-robin against the input model; candidates are then tried fastest first, and the first that meets the
budget on the calibration text windows and then on the held-back ones (``graphopt.generate.quality``) is kept.
The LM head (the MatMul whose N is the vocabulary) and the token embedding are then quantized one after the
other, each kept only when the budget still holds (``head`` / ``embedding``: ``auto``; ``false`` keeps them
float). A table the LM head shares (tied embeddings, the head reading it through a Transpose) stays float: a
4-bit copy for the Gather would add to the file, not replace it. ``accuracy_level`` 4 computes with int8 activations (lossy beyond the 4-bit weights): on some CPUs it
is the only level faster than fp32 (MatMulNBits at level 1 measured 0.7x fp32 on MiniLM's shapes).

fp32 weights that already are 4-bit affine blocks (``w = d·q + m`` per 32 along K: the dequantized Q4_1 tensors
of a GGUF file exported to fp32) are not re-quantized, which would lose a second time: they become
``MatMulNBits(x, q, d, zero points 0) + ReduceSum(x per block of 32) @ m`` (exact at ``accuracy_level`` 1).

A model that already holds 4-bit blocks (``MatMulNBits`` nodes, e.g. ``graphopt export`` of a GGUF file: exact
Q4_1 blocks plus a float block-sum correction MatMul) is not re-quantized: its plain MatMuls stay float, and its
MatMulNBits nodes go to ``accuracy_level`` 4 only when that measures faster and the budget holds.

At ``accuracy_level`` 4 (chosen, or reached on a model already in blocks) two more stages follow
(:mod:`.blocks8`); every combination of them is timed round-robin against the model as it is, and the fastest
that is faster and meets the budget is kept: ``fold_minimums`` turns each exact Q4_1 chain (MatMulNBits + the four-node block-sum
correction) into one 8-bit MatMulNBits whose zero points carry the minimums (within 1/32 of a 4-bit step), and
``head`` turns the LM head, a tied one too (``Transpose`` of the embedding table, a Q8_0 table exactly), into an
8-bit MatMulNBits (``auto``: when faster; ``true``: also when not measured faster; ``false``: never).

Weights re-quantized here (not already 4-bit blocks) are first scaled activation-aware (``awq``, :mod:`.awq`,
AWQ): per group of projections reading one normalised (or gated-FFN) activation, ``x·W = (x/s)·(s·W)`` with the
``1/s`` folded into the norm's scale or the up projection, ``s = mean|x|^α`` searched on the calibration rows;
then each RTN block's range is clipped to the ratio that minimises its activation-weighted error (``clip``).
When no kernel meets the budget with 4 bits everywhere (``mixed``), the projections with the largest local 4-bit
error go to 8-bit ``MatMulNBits`` (at ``accuracy_level`` 4; ONNX Runtime 1.32's 8-bit kernel is slow at other
levels, where they stay float), the fewest of a ladder of shares that meet the budget. Below 4 bits: ONNX Runtime
1.32's CPU ``MatMulNBits`` has 2-bit kernels but no 3-bit one, and its 2-bit kernel measured slower than the 4-bit
one at batch 1 (576 x 1536, 1 thread: 34 against 26 us at level 4, 1.95 ms at level 1), so no 2-bit form is offered.

Budget (``--budget``; default :attr:`QuantizeInt4Pass.default_budget`): decoder metrics only (``ppl_ratio``,
``greedy_match``), measured against the pipeline's input model on text (``ctx.decoder``; a direct call
measures against the model as given, on the default held-out text). ``method=gptq`` quantizes with GPTQ
(symmetric; XᵀX of each projection's input from the calibration windows), else RTN (ONNX Runtime's quantizer).

Refuses (model unchanged): no decoder with past (UsageError), no constant 2-D float32 MatMul weight with
K >= 16, no candidate meeting the budget (``budget_met=False``).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import Comparison
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate import quality
from graphopt.generate.loop import Decoder
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common import activations, decode_timing, lossy
from graphopt.rewrites.common.q41_chain import drop_zero_points
from graphopt.rewrites.quantize import awq, blocks8, int4_graph, nbits
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)

Kernel = tuple[int, int]  # (block_size, accuracy_level)
#: the shares of the re-quantized projections tried in 8 bits (or float) when 4 bits everywhere miss the budget
MIXED_SHARES = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 1.0)


def _ints(spec: str, what: str, allowed) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in str(spec).split(",") if v.strip())
    except ValueError:
        raise UsageError(f"quantize-int4.{what} must be comma-separated integers, got {spec!r}") from None
    bad = [v for v in vals if not allowed(v)]
    if not vals or bad:
        raise UsageError(f"quantize-int4.{what}: {bad[0] if bad else spec!r} is not allowed")
    return vals


def _tri(value: str, what: str) -> str:
    v = str(value).strip().lower()
    v = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(v, v)
    if v not in ("auto", "true", "false"):
        raise UsageError(f"quantize-int4.{what} must be auto, true or false, got {value!r}")
    return v


def _weight(node: ir.Node, index: int) -> np.ndarray | None:
    v = node.inputs[index] if len(node.inputs) > index else None
    if v is None or v.const_value is None:
        return None
    t = v.const_value
    if t.dtype != ir.DataType.FLOAT or len(t.shape) != 2:
        return None
    return t.numpy()


class QuantizeInt4Pass(GraphoptPass):
    """Decoder weights to 4-bit MatMulNBits (RTN or GPTQ), the kernel measured on this CPU, under a ppl budget."""

    name = "quantize-int4"
    exact = False
    #: 5% perplexity on held-back text: what llama.cpp's 4-bit k-quants cost a 7B model (Q4_K_M ~ +2-5%);
    #: a 135M model loses more, so the recipe declines rather than ship a worse model silently
    default_budget = "ppl_ratio<=1.05"
    emits = (f"{MS_DOMAIN}::MatMulNBits", f"{MS_DOMAIN}::GatherBlockQuantized")

    def __init__(self, *, block_sizes: str = "32,64,128", accuracy_levels: str = "1,4", symmetric: bool = False,
                 method: str = "rtn", head: str = "auto", embedding: str = "auto", steps: int = 16,
                 keep_blocks: bool = True, fold_minimums: str = "auto", awq: bool = True, clip: bool = True,
                 mixed: bool = True):
        super().__init__()
        self.block_sizes = _ints(block_sizes, "block_sizes", lambda b: b >= 16 and not b & (b - 1))
        self.accuracy_levels = _ints(accuracy_levels, "accuracy_levels", lambda a: a in (0, 1, 2, 3, 4))
        if method not in ("rtn", "gptq"):
            raise UsageError(f"quantize-int4.method must be rtn or gptq, got {method!r}")
        self.symmetric, self.method = bool(symmetric), method
        self.head, self.embedding = _tri(head, "head"), _tri(embedding, "embedding")
        self.fold_minimums = _tri(fold_minimums, "fold_minimums")
        self.steps = int(steps)
        #: False: re-quantize weights that already are 4-bit affine blocks too (to compare)
        self.keep_blocks = bool(keep_blocks)
        #: activation-aware scaling of the re-quantized projections (:mod:`.awq`); 8-bit / float projections
        #: where 4 bits everywhere miss the budget
        self.awq, self.clip, self.mixed = bool(awq), bool(clip), bool(mixed)

    # ------------------------------------------------------------ the pass

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        s = lossy.BudgetSearch.of(self, ctx, default_note=True)
        s.require_decoder_terms("ppl_ratio<=1.05,greedy_match>=0.5")
        check = ctx.decoder
        if check is None:
            check = quality.decoder_check(self._session(model))
            s.note("measured against the model as given (a direct call)")
        s.note(check.rows.describe())
        nodes = list(model.graph)
        existing = [n for n in nodes if n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN]
        if existing:
            return self._prequantized(model, existing, check, s)
        vocab = self._vocab(model)
        # targets are node positions in graph order (the same in a clone; names need not be unique)
        body, head = [], []
        for i, n in enumerate(nodes):
            w = _weight(n, 1) if n.op_type == "MatMul" and n.domain in ("", "ai.onnx") else None
            if w is not None and w.shape[0] >= 16:
                (head if vocab is not None and w.shape[1] == vocab else body).append(i)
        emb = [i for i, n in enumerate(nodes) if n.op_type == "Gather" and n.domain in ("", "ai.onnx")
               and _weight(n, 0) is not None and n.attributes.get_int("axis", 0) == 0
               and n.inputs[1] is not None and n.inputs[1].name == "input_ids"]
        shared = [i for i in emb if len(nodes[i].inputs[0].uses()) > 1]
        if shared and self.embedding != "false":
            # tied embeddings: the LM head reads the same table (through a Transpose); a 4-bit copy for the
            # Gather would add to the file, not replace the float table
            s.note("the embedding table is shared with another reader (tied LM head): left float")
        emb = [i for i in emb if i not in shared]
        if not body:
            s.note("nothing to quantize (no constant 2-D float32 MatMul weight)")
            return s.result(model, False)
        # weights that already are 4-bit affine blocks (a dequantized GGUF Q4_1 export) keep them exactly
        exact = {}
        for i in body if self.keep_blocks else ():
            b = nbits.exact_blocks(nodes[i].inputs[1].const_value.numpy())
            if b is not None:
                exact[nodes[i].inputs[1].name] = b
        block_sizes = self.block_sizes
        if exact:
            block_sizes = (32,)
            s.note(f"{len(exact)} of {len(body)} projection weights already are 4-bit affine blocks of 32 (largest "
                   f"deviation {max(b.max_error for b in exact.values()):.2g}): kept exactly as MatMulNBits with "
                   "zero points 0 + ReduceSum(x per block) @ minimums, not re-quantized; block size 32")
        fresh = [i for i in body + head if nodes[i].inputs[1].name not in exact]  # weights quantized here
        stats = self._stats(model, check, fresh, xtx=self.method == "gptq") if fresh and (
            self.method == "gptq" or self.awq or self.clip or self.mixed) else {}
        src, scaled = model, []
        if self.awq and stats:
            src = model.clone()
            scaled = self._awq(src, stats, [i for i in fresh if i not in head], block_sizes[0], s)
        xtx = {nodes[i].inputs[1].name: stats[nodes[i].inputs[0].name][1] for i in fresh
               if nodes[i].inputs[0].name in stats and stats[nodes[i].inputs[0].name][1] is not None}
        if xtx:
            s.note(f"GPTQ: XᵀX of {len(xtx)} weights from the calibration windows (the rest RTN)")
        blocks: dict[tuple[str, int, bool], nbits.Blocks] = {}
        acts = {nodes[i].inputs[1].name: nodes[i].inputs[0].name for i in fresh}

        def quant(name: str, w: np.ndarray, bs: int, table: bool = False, eight: bool = False) -> nbits.Blocks:
            """The blocks of the weight initializer ``name`` (computed once per block size and width)."""
            key = (name, bs, eight)
            if name in exact and not table:
                return exact[name]
            if key not in blocks:
                if table:
                    blocks[key] = nbits.rtn_blocks(w.T, bs, self.symmetric)
                elif eight:
                    blocks[key] = nbits.rtn8_blocks(w, bs)
                elif name in xtx:
                    blocks[key] = nbits.gptq_blocks(w, xtx[name], bs)
                elif self.clip and acts.get(name) in stats:  # AWQ's clipping search on the (scaled) inputs
                    blocks[key] = awq.clipped_blocks(w, stats[acts[name]][0], bs, self.symmetric)
                else:
                    blocks[key] = nbits.rtn_blocks(w, bs, self.symmetric)
            return blocks[key]

        def build(kernel: Kernel, names, emb_names=(), eight=frozenset()) -> ir.Model:
            cand = src.clone()
            int4_graph.rewrite(cand, kernel, set(names), set(emb_names), quant, eight)
            if kernel[1] == 4:
                drop_zero_points(cand, levels=(4,))
            return cand

        kernels = [(b, a) for b in block_sizes for a in self.accuracy_levels]
        cands = {k: self._session(build(k, body)) for k in kernels}
        base = self._session(model)
        secs = decode_timing.step_seconds([Decoder(base)] + [Decoder(cands[k]) for k in kernels], steps=self.steps)
        speed = dict(zip(kernels, secs[1:]))
        s.note("decode step, 1 thread (median, round-robin): input " + f"{1e3 * secs[0]:.2f} ms; "
               + ", ".join(f"block {b} level {a} {1e3 * t:.2f} ms ({secs[0] / t:.2f}x)" for (b, a), t in speed.items()))
        del base

        def measure(sess) -> lossy.Measured:
            return s.evaluate(lambda part: Comparison({}, decoder=check.measure(sess, part)))

        chosen, held, short = None, None, {}
        for k in sorted(kernels, key=lambda k: speed[k]):
            m = measure(cands[k])
            short[k] = _shortfall(s.budget, m.calib)
            s.note(f"block {k[0]} level {k[1]}: {_text(m)}; {s.verdict(m)}")
            if s.meets(m.held):
                chosen, held = k, m.held
                break
        cands.clear()
        names, emb_names, eight = list(body), [], frozenset()
        if chosen is None and self.mixed and fresh:
            # the kernel closest to the budget on calibration (level 4 first: the 8-bit kernel is fast only there)
            near = min(kernels, key=lambda k: (k[1] != 4, short[k], speed[k]))
            found = self._mixed(src, stats, body, [i for i in body if i in fresh], near, build, measure, s)
            if found is not None:
                chosen, names, eight, held = found
        if chosen is None:
            s.note(f"budget {s.budget} cannot be met by any kernel: model left unchanged (fp32)")
            return s.result(model, False, met=False)
        for what, opt, extra, is_emb in (("LM head", self.head, head, False), ("embedding", self.embedding, emb, True)):
            if is_emb:  # GatherBlockQuantized reads whole blocks of a row
                extra = [i for i in extra if nodes[i].inputs[0].const_value.shape[1] % chosen[0] == 0]
            if not extra or opt == "false":
                continue
            trial = (names, emb_names + extra) if is_emb else (names + extra, emb_names)
            m = measure(self._session(build(chosen, *trial, eight=eight)))
            ok = s.meets(m.held)
            s.note(f"{what} in 4 bits: {_text(m)}; {'kept' if ok else 'left float: ' + s.verdict(m)}")
            if ok:
                names, emb_names, held = trial[0], trial[1], m.held
        for group, scale in scaled:
            awq.apply(model, group, scale)
        counts = int4_graph.rewrite(model, chosen, set(names), set(emb_names), quant, eight)
        if chosen[1] == 4 and (z := drop_zero_points(model, levels=(4,))):
            counts["quantize-int4-implied-zero-points"] = z
        scheme = "GPTQ, symmetric" if xtx else f"RTN, {'symmetric' if self.symmetric else 'zero points'}"
        if self.clip and stats and not xtx:
            scheme = f"{scheme}, ranges clipped"
        if scaled:
            scheme = f"AWQ-scaled, {scheme}"
        if exact:
            scheme = f"{len(exact)} exact blocks, the rest {scheme}"
        if eight:
            scheme += f"; {len(eight)} projections in 8 bits"
        elif len(names) < len(body):
            scheme += f"; {len(body) - len([i for i in names if i in body])} projections left float"
        s.note(f"chose block {chosen[0]}, accuracy_level {chosen[1]} ({scheme})")
        if chosen[1] == 4:
            more, held8 = self._stages(model, check, s, self._blocks8_stages(model))
            counts.update(more)
            held = held8 or held
        return s.result(model, True, met=True, held=held, rule_counts=counts)

    # ------------------------------------------------------------ a model already in 4-bit blocks

    def _prequantized(self, model: ir.Model, existing: list[ir.Node], check, s: lossy.BudgetSearch) -> PassResult:
        levels = sorted({n.attributes.get_int("accuracy_level", 0) for n in existing})
        s.note(f"{len(existing)} MatMulNBits already (accuracy_level {', '.join(map(str, levels))}): not re-quantized")
        if 4 not in self.accuracy_levels:
            return s.result(model, False, met=True)
        stages = [] if levels == [4] else \
            [("accuracy_level 4", _level4, False)]
        counts, held = self._stages(model, check, s, stages + self._blocks8_stages(model))
        if not counts:
            s.note("model left as it is (its blocks at their level already meet any budget against themselves)")
        return s.result(model, bool(counts), met=True, held=held, rule_counts=counts)

    def _blocks8_stages(self, model: ir.Model) -> list:
        """The 8-bit stages (:mod:`.blocks8`) the options allow, each (label, apply(model) -> rule counts, forced:
        option ``true``, kept under the budget even when not measured faster)."""
        vocab = self._vocab(model)
        out = []

        def fold(m: ir.Model) -> dict[str, int]:
            c = blocks8.fold_minimums(m)
            return {"quantize-int4-fold-minimums-8bit": c.count} if c.count else {}

        def head(m: ir.Model) -> dict[str, int]:
            c = blocks8.head_blocks8(m, vocab, level=4)
            return {"quantize-int4-head-8bit": c.count} if c.count else {}

        if self.fold_minimums != "false":
            out.append(("Q4_1 minimums folded into 8-bit blocks (no block-sum correction)", fold,
                        self.fold_minimums == "true"))
        if self.head != "false":
            out.append(("LM head in 8-bit blocks", head, self.head == "true"))
        return out

    def _stages(self, model: ir.Model, check, s: lossy.BudgetSearch, stages: list) -> tuple[dict[str, int], object]:
        """Every combination of ``stages`` (each applied in the listed order; a first stage labelled
        ``accuracy_level 4`` is part of every combination that has a later stage, which only pays off at level 4;
        a forced stage is part of every combination), timed round-robin against ``model``; the fastest that is
        faster (< 0.97x the step, or made of forced stages only) and meets the budget is applied to ``model`` in
        place. Stages need not help together: on one CPU the 8-bit head measured 1.28x and folded minimums 0.87x
        the step, so only trying the head alone finds the best form. Returns its rule counts ({} when none) and
        its held-back comparison."""
        if not stages:
            return {}, None
        base = 0 if stages[0][0].startswith("accuracy_level") else None
        combos: list[tuple[int, ...]] = []
        for mask in range(1, 1 << len(stages)):
            pick = {i for i in range(len(stages)) if mask >> i & 1 or stages[i][2]}
            if base is not None and pick - {base}:
                pick.add(base)
            key = tuple(sorted(pick))
            if key not in combos:
                combos.append(key)
        cands, seen = [], set()
        for key in combos:
            cand, counts, forced, changed = model.clone(), {}, True, []
            for i in key:
                c = stages[i][1](cand)
                if c:
                    counts, forced = {**counts, **c}, forced and stages[i][2]
                    changed.append(i)
            if not changed or tuple(changed) in seen:
                continue
            seen.add(tuple(changed))
            cands.append((" + ".join(stages[i][0] for i in changed), cand, counts, tuple(changed), forced))
        if not cands:
            return {}, None
        ref = self._session(model)
        sessions = [self._session(c[1]) for c in cands]
        secs = decode_timing.step_seconds([Decoder(ref)] + [Decoder(x) for x in sessions], steps=self.steps)
        del ref
        s.note("decode step, 1 thread: as it is " + f"{1e3 * secs[0]:.2f} ms; " + "; ".join(
            f"{c[0]} {1e3 * t:.2f} ms ({secs[0] / t:.2f}x)" for c, t in zip(cands, secs[1:])))
        # forced candidates first (the most stages first), then the faster ones, fastest first
        order = sorted((i for i, t in enumerate(secs[1:]) if t < 0.97 * secs[0] or cands[i][4]),
                       key=lambda i: (0, -len(cands[i][3])) if cands[i][4] else (1, secs[1 + i]))
        for i in order:
            label, _, c, picked, _ = cands[i]
            m = s.evaluate(lambda part, x=sessions[i]: Comparison({}, decoder=check.measure(x, part)))
            s.note(f"{label}: {_text(m)}; {s.verdict(m)}")
            if s.meets(m.held):
                for j in picked:
                    stages[j][1](model)
                return c, m.held
        s.note("no faster form meets the budget: the blocks stay as they are")
        return {}, None

    # ------------------------------------------------------------ helpers

    @staticmethod
    def _session(model: ir.Model):
        return runtime.make_session(model, threads=1, spinning=False)

    @staticmethod
    def _vocab(model: ir.Model) -> int | None:
        for v in model.graph.outputs:
            if v.name == "logits" and v.shape is not None and isinstance(v.shape[-1], int):
                return int(v.shape[-1])
        return None

    def _stats(self, model: ir.Model, check, index: list[int], *, xtx: bool) -> dict[str, list]:
        """``[sampled rows, XᵀX or None]`` of the input of each MatMul at ``index`` over the calibration windows,
        by activation name."""
        nodes = list(model.graph)
        acts = list(dict.fromkeys(nodes[i].inputs[0].name for i in index))
        feeds = [int4_graph.window_feed(model, w) for w in check.rows.windows[quality.CALIB]]
        stats = activations.collect(model, feeds, acts, xtx_for=acts if xtx else ())
        return {a: [stats[a].rows, stats[a].xtx] for a in acts if a in stats and stats[a].rows is not None}

    def _awq(self, src: ir.Model, stats: dict[str, list], index: list[int], bs: int, s: lossy.BudgetSearch) -> list:
        """AWQ scales (:mod:`.awq`) searched per group under RTN at block ``bs`` and applied to ``src`` in place;
        ``stats`` then describe the scaled activations. Returns [(group, s)] of the groups scaled."""
        def qdq(w: np.ndarray) -> np.ndarray:
            return nbits.dequant(nbits.rtn_blocks(w, bs, self.symmetric), w.shape[0])

        gs = awq.groups(src, set(index))
        out, before, after, alphas = awq.scale_groups(src, gs, stats, qdq)
        if gs:
            s.note(f"AWQ: {len(out)} of {len(gs)} groups of projections scaled ({sum(len(g.matmuls) for g, _ in out)} "
                   f"weights{f', alpha {min(alphas):.2f}-{max(alphas):.2f}' if alphas else ''}): their local 4-bit "
                   f"output error on the calibration rows (RTN, block {bs}) {after / max(before, 1e-30):.3f}x of "
                   "without")
        else:
            s.note("AWQ: no projections whose input can absorb a scale (a norm, a Mul by a constant, a gated FFN)")
        return out

    def _mixed(self, src: ir.Model, stats: dict[str, list], body: list[int], index: list[int], kernel: Kernel,
               build, measure, s: lossy.BudgetSearch):
        """4 bits everywhere missed the budget: the projections at ``index`` with the largest local 4-bit error
        (:func:`.awq.relative_error`, RTN at the kernel's block size) go to 8 bits at ``accuracy_level`` 4 (ONNX
        Runtime's 8-bit kernel is fast only there) or stay float at other levels; the fewest of the ladder
        :data:`MIXED_SHARES` that meet the budget (binary search). Returns (kernel, names, eight, held) or None."""
        nodes = list(src.graph)
        bs, level = kernel
        err = {}
        for i in index:
            st = stats.get(nodes[i].inputs[0].name)
            if st is not None:
                w = nodes[i].inputs[1].const_value.numpy()
                err[i] = awq.relative_error(st[0], w, nbits.dequant(nbits.rtn_blocks(w, bs, self.symmetric), len(w)))
        order = sorted(err, key=lambda i: -err[i])
        if not order:
            return None
        # float at every projection is the input, not a quantized model
        counts = sorted({c for f in MIXED_SHARES if (c := max(1, round(len(order) * f))) < len(order) or level == 4})
        if not counts:
            return None
        wide = "8 bits" if level == 4 else "float"

        def pick(j: int) -> tuple[list[int], frozenset[int]]:
            top = frozenset(order[:counts[j]])
            return (list(body), top) if level == 4 else ([i for i in body if i not in top], frozenset())

        def one(j: int) -> lossy.Measured:
            names, eight = pick(j)
            return measure(self._session(build(kernel, names, eight=eight)))

        def seen(j: int, m: lossy.Measured) -> None:
            s.note(f"block {bs} level {level}, {counts[j]} of {len(order)} projections in {wide} (the largest local "
                   f"4-bit error first): {_text(m)}; {s.verdict(m)}")

        j, done = s.first_confirmed(len(counts), one, seen)
        if j is None:
            return None
        return (kernel, *pick(j), done[j].held)


def _shortfall(budget, c: Comparison | None) -> float:
    """How far ``c`` misses ``budget``: the sum of each term's relative shortfall (0 when it holds)."""
    gaps = [(c.worst(t.metric) - t.value) * (1 if t.op in ("<=", "<") else -1) / max(abs(t.value), 1e-9)
            for t in budget.terms] if c is not None else [math.inf]
    return math.inf if any(math.isnan(g) for g in gaps) else sum(max(0.0, g) for g in gaps)


def _text(m: lossy.Measured) -> str:
    def one(c: Comparison | None) -> str:
        if c is None:
            return "n/a"
        d = c.decoder
        return f"ppl_ratio {d['ppl_ratio']:.4f} (ppl {d['ppl']:.3f} vs {d['ppl_reference']:.3f}), " \
               f"greedy_match {d['greedy_match']:.3f}"
    return f"calibration {one(m.calib)}; held-back {one(m.held)}"


def _level4(model: ir.Model) -> dict[str, int]:
    """Every MatMulNBits to accuracy_level 4, the exact Q4_1 chains read with the implied zero point 8: at level 4
    the int8 activations then multiply the centred ``q - 8`` and the ``8d`` part of each weight is summed in fp32
    (SmolLM2, held-out text: perplexity 15.37 against 15.42 with zero points 0; the exact model's is 15.25)."""
    counts = {"quantize-int4-accuracy-level-4": _set_level(model, 4)}
    if z := drop_zero_points(model, levels=(4,)):
        counts["quantize-int4-implied-zero-points"] = z
    return counts


def _set_level(model: ir.Model, level: int) -> int:
    n = 0
    for node in model.graph:
        if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
            node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", level)
            n += 1
    return n


register(QuantizeInt4Pass)
