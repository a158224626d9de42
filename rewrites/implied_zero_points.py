"""``implied-zero-points``: the exact Q4_1 form without its zero-point input, the minimums shifted by ``8·d``.

The GGUF exporter (:mod:`graphopt.exporters.gguf_blocks`) writes each Q4_1 projection ``w = d·q + m`` as
``MatMulNBits(x, q, d, zero points 0) + ReduceSum(x per block) @ m``. Given no zero-point input, ONNX Runtime's
4-bit ``MatMulNBits`` implies 8 (``w = d·(q - 8)``), and that kernel is the faster one: on an AMD EPYC (AVX-512)
at batch 1, 1 thread, the fp32-activation kernel (``accuracy_level`` 1) took 106 against 121 us on a 576 x 3072
weight, 52 against 62 us on 1536 x 576 (equal at level 4). ``d·q + m = d·(q - 8) + (m + 8d)``, so::

    x ─┬─ MatMulNBits(q, d, 0) ──────────────────────┐
       └─ Reshape ─ ReduceSum ─ MatMul(m) ─────────── Add ─▶ y
                        ==>
    x ─┬─ MatMulNBits(q, d) ─────────────────────────┐
       └─ Reshape ─ ReduceSum ─ MatMul(m + 8·d) ───── Add ─▶ y

The same products; only the fp32 rounding of the sums moves (~1e-7 relative). Nothing else changes. On a decoder
with past the decode step (batch 1, 1 thread) is timed round-robin against the model as it is, and the rewrite is
kept unless it measures slower (> 1.03x the step): never assumed faster on a CPU it was not measured on
(``measure=false`` applies it untimed).

Only chains at ``accuracy_level`` 0 or 1 (fp32 activations, where the rewrite is exact); at level 4
``quantize-int4`` uses this form itself (there it moves the output: closer to the fp32 weights).

Runs after the passes that read the chain with its zero points (``merge-projections``, ``quantize-int4``,
``decode-sparsity``): the decoder recipes have it as their last step. Declined (graph unchanged, a note) when
no chain is found.
"""

from __future__ import annotations

import onnx_ir as ir

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate.loop import Decoder
from graphopt.rewrites.common.decode_timing import step_seconds
from graphopt.rewrites.common.q41_chain import drop_zero_points
from graphopt.runtime import session as runtime

#: kept unless the candidate's decode step is slower than this many times the input's
SLOWER = 1.03


class ImpliedZeroPointsPass(GraphoptPass):
    """Exact Q4_1 MatMulNBits chains without zero points (ONNX Runtime's implied 8), minimums shifted by 8·d."""

    name = "implied-zero-points"
    exact = True
    emits = ("com.microsoft::MatMulNBits",)
    in_default_recipe = False

    def __init__(self, *, steps: int = 16, measure: bool = True):
        super().__init__()
        if not isinstance(measure, bool):
            raise UsageError(f"implied-zero-points.measure must be true or false, got {measure!r}")
        self.steps, self.measure = int(steps), measure

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        cand = model.clone()
        count = drop_zero_points(cand)
        if not count:
            return PassResult(model, False, notes=["not applied: no MatMulNBits(x, q, d, zero points 0) + block-sum "
                                                   "x minimum chain (the exact Q4_1 form)"])
        notes = [f"{count} Q4_1 chains: zero points 0 -> implied 8, minimums + 8·d"]
        timed = self._timed(model, cand) if self.measure else None
        if timed is not None:
            base, new = timed
            notes.append(f"decode step, 1 thread: {1e3 * base:.2f} -> {1e3 * new:.2f} ms ({base / new:.2f}x)")
            if new > SLOWER * base:
                notes.append(f"not kept: slower than {SLOWER}x the step as it is")
                return PassResult(model, False, notes=notes)
        else:
            notes.append("applied untimed (measure=false), an exact rewrite" if not self.measure else
                         "not timed (no decoder signature with past): applied, an exact rewrite")
        drop_zero_points(model)
        return PassResult(model, True, notes=notes, rule_counts={"implied-zero-points": count})

    def _timed(self, model: ir.Model, cand: ir.Model) -> tuple[float, float] | None:
        try:
            decs = [Decoder(runtime.make_session(m, threads=1, spinning=False)) for m in (model, cand)]
        except UsageError:  # not a decoder with past: the step cannot be timed
            return None
        base, new = step_seconds(decs, steps=self.steps)
        return base, new


register(ImpliedZeroPointsPass)
