"""``quantize``: int8 / int4 quantization under an accuracy budget (lossy; never in the default recipe).

Modes (``mode=``):

- ``dynamic``: per-channel symmetric int8 weights, activations quantized at run time
  (``DynamicQuantizeMatMul``; fused ``Attention`` -> ``DynamicQuantizeLinear`` + ``QAttention``);
- ``static``: activation ranges calibrated on ``ctx.calib_feeds`` (``calibrator=minmax|percentile|
  entropy|auto``; auto picks per tensor by local error), u8 activations / s8 weights on CPU, s8/s8 for
  CUDA (``act_type``); ``format=qop`` emits ``QuantizeLinear`` + ``MatMulIntegerToFloat`` /
  ``QAttention`` directly, ``format=qdq`` emits standard Q/DQ pairs for ORT's QDQ fusions (default: qop
  on CPU, qdq on CUDA);
- ``int4``: weight-only ``MatMulNBits`` (``block_size``, ``accuracy_level``; ``int4_method=gptq|rtn``,
  default gptq: on MiniLM it keeps 4 layers float where RTN needs 5 float + 16 int8);
- ``auto`` (default): tries static then dynamic and keeps the one that meets the budget with the
  fewest float layers (static wins ties: no run-time range reduction).

``smoothquant=true`` migrates activation outliers into the weights (``alpha`` a number or ``auto``).
``embeddings`` stores embedding tables (constant Gather tables, the word table of a fused
``EmbedLayerNormalization``, unfused to Gather + DequantizeLinear + SkipLayerNormalization) as int8
(default ``auto``: yes where only the gathered rows are dequantized at run time; an
EmbedLayerNormalization that cannot be unfused gets a whole-table DequantizeLinear per run, only in
int4 mode; ``false``: keep tables float). In int4
mode fused Attention weights go to int8 ``QAttention`` (no 4-bit attention kernel), and the layers the
budget search takes out of 4 bits fall back to int8 (``DynamicQuantizeMatMul``), not float.

Budget: ``ctx.budget`` (``--budget``, or ``metrics.DEFAULT_BUDGET``), searched through ``common.lossy``
(``search.py``). With
``mixed=true`` each layer's sensitivity is measured (``sensitivity=model``: the budget
metric with only that layer quantized, one session per layer; ``sensitivity=local``: the layer's own
relative output error on sampled calibration rows, no extra sessions, but a worse ranking: on MiniLM
dynamic it kept 4 layers float where ``model`` keeps 1, for 20% less search time; ``auto``, the default:
``model``, but ``local`` for models whose weights are streamed from disk (external data or over 256 MB),
where a session per layer would make the search time grow with the square of the size), and the most
sensitive layers are kept float until the budget holds on the calibration
feeds; the result is then confirmed on the held-back feeds (more layers kept float if it fails there).
Both numbers go to the notes. When no quantized model meets the budget the model is left unchanged
(``modified=False``) and the notes say so.

Large models (weights in external data or over 256 MB, ``graphopt.io.streams``): calibration runs
layer by layer (``_quant_calib``: segments of about 1/16 of the weights, one segment's session and
activations at a time; GPTQ runs for each activation as soon as its XᵀX is complete, and XᵀX is
dropped), the float model's outputs are kept spilled to disk and its session freed before the search,
each candidate's session is built after the previous one is gone, and weights are read one at a
time (copied out of their memory map, large ones quantized in column blocks). Peak memory stays
near the size of the weights (docs/benchmarks.md, issue 14).

Refuses (keeps float): see ``qdq``; graphs without constant-weight MatMul/Attention are left
unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from graphopt import io, memory
from graphopt.data.feeds import split_feeds
from graphopt.data.metrics import DEFAULT_BUDGET, Comparison, parse_budget
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.engine.verify import run_session
from graphopt.errors import UsageError
from graphopt.opsets import MS_DOMAIN
from graphopt.rewrites.common import activations as calib_mod
from graphopt.rewrites.common import lossy
from graphopt.rewrites.quantize import numeric, qdq
from graphopt.rewrites.quantize import smooth as smooth_mod
from graphopt.rewrites.quantize import targets as targets_mod
from graphopt.rewrites.quantize.int4 import gptq_int4
from graphopt.rewrites.quantize.search import Outcome, Search
from graphopt.rewrites.quantize.targets import QConfig, Target
from graphopt.runtime import session as runtime
from graphopt.runtime import standins

logger = logging.getLogger(__name__)

MODES = ("auto", "dynamic", "static", "int4")
CALIBRATORS = ("auto", "minmax", "percentile", "entropy")
INTEGER_OPS = ("QLinear", "MatMulInteger", "DynamicQuantize", "QAttention", "MatMulNBits", "QEmbed",
               "QGemm", "QuantizeLinear")


class QuantizePass(GraphoptPass):
    """Quantize MatMul/Attention weights (and activations) to int8 or int4 under an accuracy budget."""

    name = "quantize"
    default_budget = DEFAULT_BUDGET
    exact = False
    emits = tuple(f"{MS_DOMAIN}::{op}" for op in ("DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QAttention",
                                                  "MatMulNBits"))

    def __init__(
        self,
        *,
        mode: str = "auto",
        calibrator: str = "auto",
        percentile: float = 99.99,
        format: str = "auto",  # noqa: A002 - the option's user-facing name
        act_type: str = "auto",
        smoothquant: str = "auto",
        alpha: str = "auto",
        mixed: bool = True,
        keep_float: str = "",
        embeddings: str = "auto",
        block_size: int = 32,
        accuracy_level: int = 4,
        int4_method: str = "gptq",
        sensitivity_feeds: int = 2,
        sensitivity: str = "auto",
    ):
        super().__init__()
        if mode not in MODES:
            raise UsageError(f"quantize.mode must be one of {', '.join(MODES)}, got {mode!r}")
        if calibrator not in CALIBRATORS:
            raise UsageError(f"quantize.calibrator must be one of {', '.join(CALIBRATORS)}, got {calibrator!r}")
        if format not in ("auto", "qop", "qdq"):
            raise UsageError(f"quantize.format must be auto, qop or qdq, got {format!r}")
        if act_type not in ("auto", "u8", "s8"):
            raise UsageError(f"quantize.act_type must be auto, u8 or s8, got {act_type!r}")
        if int4_method not in ("rtn", "gptq"):
            raise UsageError(f"quantize.int4_method must be rtn or gptq, got {int4_method!r}")
        if str(alpha) != "auto":
            try:
                float(alpha)
            except ValueError:
                raise UsageError(f"quantize.alpha must be a number or 'auto', got {alpha!r}") from None
        if sensitivity not in ("auto", "local", "model"):
            raise UsageError(f"quantize.sensitivity must be auto, local or model, got {sensitivity!r}")
        if block_size < 16 or block_size & (block_size - 1):
            raise UsageError(f"quantize.block_size must be a power of two >= 16, got {block_size}")
        self.mode, self.calibrator, self.percentile = mode, calibrator, float(percentile)
        self.format, self.act_type = format, act_type
        sq = str(smoothquant).strip().lower()
        if sq not in ("auto", "true", "false", "1", "0", "yes", "no", "on", "off"):
            raise UsageError(f"quantize.smoothquant must be auto, true or false, got {smoothquant!r}")
        self.smoothquant = "auto" if sq == "auto" else ("true" if sq in ("true", "1", "yes", "on") else "false")
        self.alpha = str(alpha)
        emb = str(embeddings).strip().lower()
        self.mixed, self.keep_float = bool(mixed), keep_float
        #: auto: int8 embedding tables wherever only the gathered rows are dequantized at run time; a
        #: fused EmbedLayerNormalization that cannot be unfused keeps a float table (a whole-table
        #: DequantizeLinear per run) except in int4 mode, where size is the point
        self.embeddings = True if emb == "auto" else emb in ("true", "1", "yes", "on")
        self._whole_table_dq = mode == "int4" or emb != "auto"
        self.block_size, self.accuracy_level, self.int4_method = block_size, accuracy_level, int4_method
        self.sensitivity_feeds, self.sensitivity = sensitivity_feeds, sensitivity

    # ------------------------------------------------------------ helpers

    def build(self, model: ir.Model, plan: Mapping[str, QConfig], factors: Mapping[str, np.ndarray]
              ) -> tuple[ir.Model, dict[str, int]]:
        """Apply ``plan`` (and SmoothQuant ``factors``) to ``model`` in place."""
        plan = {k: dataclasses.replace(v) for k, v in plan.items()}
        targets = targets_mod.find_targets(model, embeddings=self.embeddings)
        counts: dict[str, int] = {}
        if factors:
            # x / s is folded into the producer or done by a Mul: x / s inside a per-channel QuantizeLinear
            # is exact too, but ORT 1.32's per-axis QuantizeLinear on CPU measured ~10x slower than Mul +
            # per-tensor QuantizeLinear (MiniLM)
            counts.update(smooth_mod.apply_smoothing(model, targets, factors))
            # float-kept readers of a smoothed (folded or Mul) activation get their weights scaled (exact)
            for t in targets:
                name = t.act.name if t.act is not None else None
                if name in factors and t.key not in plan:
                    s = factors[name]
                    t.weight.const_value = ir.tensor(t.weight_array * s.reshape(-1, 1), name=t.weight.name)
        counts.update(qdq.apply(model, targets, plan))
        return model, counts

    # ------------------------------------------------------------ the pass

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        s = lossy.BudgetSearch.of(self, ctx, default_note=True)
        note = s.note
        s.rows(model, ctx)
        calib = s.calib
        targets = targets_mod.find_targets(model, embeddings=self.embeddings)
        if not targets:
            note("nothing to quantize (no MatMul/Attention with constant weights)")
            return s.result(model, False)
        keep = {k.strip() for k in self.keep_float.split(",") if k.strip()}
        provider = ctx.provider
        act_type = self.act_type if self.act_type != "auto" else ("s8" if provider == "cuda" else "u8")
        fmt = self.format if self.format != "auto" else ("qdq" if provider == "cuda" else "qop")
        if provider == "cuda" and self.mode in ("auto", "dynamic"):
            note("CUDA: dynamic int8 ops have CPU kernels only; using static QDQ")
        base_modes = {"auto": ["static", "dynamic"], "dynamic": ["dynamic"], "static": ["static"],
                      "int4": ["int4"]}[self.mode]
        if provider == "cuda" and self.mode == "auto":
            base_modes = ["static"]
        modes: list[tuple[str, bool]] = []
        for m in base_modes:
            if m == "int4" or self.smoothquant == "false":
                modes.append((m, False))
            elif self.smoothquant == "true":
                modes.append((m, True))
            elif m == "static":  # auto: static with SmoothQuant first (best measured), then plain
                modes += [(m, True), (m, False)]
            else:
                modes.append((m, False))
        any_sq = any(sq for _, sq in modes)
        # int8 weight storage for this CPU's int8 kernel (measured once per process): s8 where ORT's kernel
        # is exact, as always. Dynamic int8 ops (u8 activations; int4's QAttention and int8 fallback) run
        # on the CPU kernels whatever the provider; static ones on CUDA run CUDA's
        weights = {"static": "s8", "dynamic": "s8"}
        used = {"static": act_type} if "static" in base_modes and provider != "cuda" else {}
        if "dynamic" in base_modes or "int4" in base_modes:
            used["dynamic"] = "u8"
        for m, act in used.items():
            weights[m], why = numeric.int8_weights(act)
            if why:
                note(f"{m}: {why}")

        # a --provider cuda model may hold CUDA-only ops (remove-padding's PackedMultiHeadAttention):
        # calibration and the budget search run on CPU through their exact standard-op stand-ins.
        # The float outputs are kept (spilled to disk past a memory budget), the session is not: at most
        # one session (calibration, then each candidate) holds weights at a time
        sess = runtime.make_session(standins.cpu_runnable(model)[0], threads=1)
        s.reference(functools.partial(run_session, sess))
        del sess
        memory.trim()
        sensitivity = self.sensitivity
        if sensitivity == "auto":
            # a model-sensitivity ranking makes one session of the whole model per layer: its cost grows
            # with the square of the size; models streamed from disk rank by local error instead
            sensitivity = "local" if io.streams(model) else "model"

        act_names = [t.act.name for t in targets if t.act is not None]
        static = any(m == "static" for m, _ in modes)
        need_stats = static or any_sq or (self.mode == "int4" and self.int4_method == "gptq") or \
            (self.mixed and sensitivity == "local")
        gptq = self.mode == "int4" and self.int4_method == "gptq"
        int4_q: dict[str, tuple[np.ndarray, np.ndarray]] = {}

        def reduce(name: str, st: calib_mod.Stats) -> None:
            """GPTQ of the layers reading ``name`` as soon as its XᵀX is complete; XᵀX is then dropped."""
            if st.xtx is None:
                return

            readers = [t for t in targets if t.kind == "matmul" and t.act is not None and t.act.name == name]
            for t in readers:
                int4_q[t.key] = gptq_int4(t.weight_array, st.xtx, self.block_size)
            st.xtx = None

        stats: dict[str, calib_mod.Stats] = {}
        if need_stats:
            # models streamed from disk calibrate layer by layer: one segment's weights in memory at a time
            segment = max(1, io.tensor_bytes(model) // calib_mod.SEGMENTS) if io.streams(model) else None
            stats = calib_mod.collect(
                model, calib, act_names,
                histograms=static and self.calibrator != "minmax",
                xtx_for=act_names if gptq else (),
                segment_bytes=segment,
                on_done=reduce if gptq else None,
            )

        run = Search(s, self.build, model, targets, self.mixed, self.sensitivity_feeds, stats, sensitivity,
                     int8=QConfig("dynamic", weights=weights["dynamic"]))
        outcomes = []
        ranking: list[str] | None = None
        for mode, sq in modes:
            plan, factors, info = self._base_plan(mode, sq, targets, stats, act_type, fmt, int4_q, weights)
            for k in keep:
                plan.pop(k, None)
            label = mode + ("+smoothquant" if sq else "")
            note(f"{label}: {info}")
            out, ranking = run.search(label, plan, factors, ranking)
            outcomes.append(out)
            if out.ok and not out.floats:
                break

        good = [o for o in outcomes if o.ok]
        for o in outcomes:
            note(self._describe(o))
        if not good:
            note(f"budget {s.budget} cannot be met by any quantized model: model left unchanged (fp32)")
            return s.result(model, False, met=False)
        labels = [o.mode for o in outcomes]
        best = min(good, key=lambda o: (o.float_macs, labels.index(o.mode)))
        _, counts = self.build(model, best.plan, best.factors)
        rule_counts = {f"quantize-{k}": v for k, v in counts.items()}
        rule_counts["quantize-kept-float"] = len(best.floats)
        if best.int8:
            rule_counts["quantize-int4-as-int8"] = len(best.int8)
        note(f"chose {best.mode}" + (f" (format {fmt}, {act_type} activations)" if best.mode.startswith("static") else ""))
        note(self._integer_ops_note(model))
        return s.result(model, True, met=True, held=best.held, rule_counts=rule_counts)

    def _base_plan(self, mode: str, sq: bool, targets: list[Target], stats, act_type: str, fmt: str,
                   int4_q: Mapping[str, tuple[np.ndarray, np.ndarray]], weights: Mapping[str, str]):
        plan: dict[str, QConfig] = {}
        factors: dict[str, np.ndarray] = {}
        info: list[str] = []
        if sq and mode != "int4":
            groups: dict[str, list[Target]] = {}
            for t in targets:
                if t.act is not None and t.act.name in stats and stats[t.act.name].rows is not None:
                    groups.setdefault(t.act.name, []).append(t)
            alphas = []
            for name, group in groups.items():
                if any(len(t.weight.uses()) != 1 for t in group):
                    continue
                s, a = smooth_mod.choose(stats[name], group, self.alpha, static=mode == "static")
                factors[name] = s
                alphas.append(a)
            if alphas:
                info.append(f"SmoothQuant on {len(factors)} activations (alpha {self.alpha}: "
                            f"{', '.join(f'{a:g}' for a in sorted(set(alphas)))})")
        chosen = Counter()
        for t in targets:
            if t.kind in ("gather", "embed_table"):
                plan[t.key] = QConfig("gather", whole_table_dq=self._whole_table_dq)
                continue
            if mode == "int4":
                if t.kind == "attention":  # no 4-bit attention kernel: int8 QAttention instead
                    plan[t.key] = QConfig("dynamic", weights=weights["dynamic"])
                    continue
                cfg = QConfig("int4", block_size=self.block_size, accuracy_level=self.accuracy_level)
                if self.int4_method == "gptq" and t.key in int4_q:  # computed during calibration
                    cfg.int4_q = int4_q[t.key]
                plan[t.key] = cfg
                continue
            cfg = QConfig(mode, act_type=act_type, fmt=fmt, weights=weights[mode])
            if mode == "static":
                if fmt == "qdq" and t.kind == "attention":
                    continue  # ORT has no QDQ -> QAttention fusion: keep float
                st = stats.get(t.act.name)
                if st is None:
                    continue
                s = factors.get(t.act.name)
                cfg.act_range, which = self._range(st, t, s, act_type)
                chosen[which] += 1
            cfg.smooth = factors.get(t.act.name)
            plan[t.key] = cfg
        if chosen:
            info.append("calibrators " + ", ".join(f"{k} x{v}" for k, v in sorted(chosen.items())))
        info.append(f"{len(plan)} of {len(targets)} targets quantized")
        return plan, factors, "; ".join(info)

    def _range(self, st: calib_mod.Stats, t: Target, s: np.ndarray | None, act_type: str):
        if s is not None:  # smoothed: the range of x / s (per-channel bounds)
            lo, hi = float(np.min(st.chan_min / s)), float(np.max(st.chan_max / s))
            return (min(lo, 0.0), max(hi, 0.0)), "minmax(smoothed)"
        cands = [self.calibrator] if self.calibrator != "auto" else ["minmax", "percentile", "entropy"]
        best = None
        cache: dict = {}  # the weight is quantized once for all the candidates
        w = t.weight_array if len(cands) > 1 and st.rows is not None else None
        for c in cands:
            r = calib_mod.act_range(st, c, self.percentile)
            if len(cands) == 1 or st.rows is None:
                return r, c
            err = smooth_mod.local_error(st.rows, w, None, r, act_type, cache=cache)
            if best is None or err < best[0]:
                best = (err, r, c)
        return best[1], best[2]

    def _describe(self, o: Outcome) -> str:
        def m(c: Comparison | None) -> str:
            if c is None:
                return "n/a"
            return f"cosine {c.worst('cosine'):.5f} / min {c.worst('cosine_min'):.5f}"

        def names(ks: list[str]) -> str:
            return ", ".join(ks[:4]) + (" ..." if len(ks) > 4 else "")

        parts = [f"{len(o.floats)} kept float ({names(o.floats)})"] if o.floats else []
        if o.int8:
            parts.append(f"{len(o.int8)} int8 ({names(o.int8)})")
        fl = "; ".join(parts) or "all quantized"
        verdict = "meets the budget" if o.ok else "fails the budget"
        return f"{o.mode}: {fl}; calibration {m(o.calib)}; held-back {m(o.held)}; {verdict}"

    def _integer_ops_note(self, model: ir.Model) -> str:
        """Which nodes ORT (CPU, all optimizations) actually runs as integer ops."""
        try:
            import onnxruntime as ort

            with tempfile.TemporaryDirectory(prefix="graphopt-q-") as d, \
                    io.materialize(standins.cpu_runnable(model)[0]) as src:
                path = os.path.join(d, "opt.onnx")
                so = runtime.session_options(threads=1)
                so.optimized_model_filepath = path
                # the optimized graph's weights go to a file of their own (a model over 2 GB cannot be
                # one protobuf); only the graph is read back
                so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "opt.data")
                so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                            "1024")
                ort.InferenceSession(src if isinstance(src, str) else src.SerializeToString(), so,
                                     providers=["CPUExecutionProvider"])
                ops = Counter(n.op_type for n in onnx.load(path, load_external_data=False).graph.node)
        except Exception as e:  # noqa: BLE001 - informative only
            return f"could not inspect the ORT-optimized graph: {e}"
        integer = {k: v for k, v in ops.items() if any(k.startswith(p) for p in INTEGER_OPS)}
        flt = {k: v for k, v in ops.items() if k in ("MatMul", "Gemm", "FusedMatMul", "Attention")}
        return ("ORT CPU optimized graph: integer ops " + (", ".join(f"{k} x{v}" for k, v in sorted(integer.items()))
                or "none") + "; float matmul-like ops " + (", ".join(f"{k} x{v}" for k, v in sorted(flt.items()))
                                                           or "none"))


def quantize_model(model: ir.Model, feeds: Sequence[Mapping[str, np.ndarray]], *, budget: str | None = None,
                   provider: str = "cpu", **options) -> tuple[ir.Model, list[str]]:
    """Convenience: quantize ``model`` in place with the first half of ``feeds`` for calibration."""

    calib, held = split_feeds(list(feeds))
    ctx = PassContext(provider=provider, feeds=held, calib_feeds=calib,
                      budget=parse_budget(budget) if budget else None)
    return model, QuantizePass(**options)(model, ctx).notes


register(QuantizePass)

from graphopt.rewrites.quantize import decoder_int4  # noqa: E402,F401 - registers ``quantize-int4``
