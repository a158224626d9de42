"""The search plan: which candidates (chains of lossy steps on a lossless base) a search tries, in order.

Stage 1 tries each lossy pass alone; stage 2 tries combinations whose first pass fitted the budget alone
(prune-heads or sparsify, then quantize), and int4 last on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import onnx_ir as ir

from graphopt.engine import recipe as recipe_mod

#: lossy pass families the search knows
FAMILIES = ("quantize", "prune-heads", "sparsify", "early-exit", "convert-precision")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Lossy steps on top of a base (a lossless recipe's output)."""

    name: str
    base: str
    steps: tuple[recipe_mod.Step, ...]
    stage: int = 1
    #: stage 2: only tried when this stage-1 candidate met the budget
    needs: str = ""

    def settings(self) -> list[dict]:
        return [{"pass": s.pass_name, "options": dict(s.options)} for s in self.steps]


def _step(name: str, **options: Any) -> recipe_mod.Step:
    return recipe_mod.Step(name, dict(options))


def plan(families: Sequence[str], provider: str, classifier: bool) -> tuple[list[Candidate], list[str]]:
    """The candidates, stage 1 first, cheapest and likeliest first; and notes on what was left out."""
    fam = set(families)
    q, ph, sp = "quantize", "prune-heads", "sparsify"
    c: list[Candidate] = []
    notes: list[str] = []
    if q in fam:
        c += [Candidate("int8", "default", (_step(q),)),  # the `int8` recipe
              Candidate("int8-dynamic", "default", (_step(q, mode="dynamic"),)),
              # every layer int8, no search for float layers: the fastest int8 form, if the budget allows
              Candidate("int8-static-all", "default", (_step(q, mode="static", mixed=False),))]
    if ph in fam:
        c.append(Candidate("prune-heads", "default", (_step(ph),)))
    if sp in fam:
        c.append(Candidate("sparsify-neurons", "default", (_step(sp, pattern="neurons"),)))
    if "early-exit" in fam:
        if classifier:
            c.append(Candidate("early-exit", "no-padding-removal", (_step("early-exit"),)))
        else:
            notes.append("early-exit: not tried (the model's output is not class logits [batch, classes])")
    if "convert-precision" in fam:
        if provider == "cuda":
            c.append(Candidate("fp16", "default", (_step("convert-precision", precision="fp16"),)))
        else:
            notes.append("convert-precision: not tried on cpu (ONNX Runtime's CPU provider runs fp16 ops "
                         "through casts to fp32: never faster)")
    if q in fam:
        if ph in fam:
            c += [Candidate(f"prune-heads-{int(s * 100)}+int8", "default",
                            (_step(ph, budget_share=s), _step(q)), stage=2, needs="prune-heads")
                  for s in (0.5, 0.25)]
        if sp in fam:
            c += [Candidate(f"neurons-{int(s * 1000) / 10:g}%+int8", "default",
                            (_step(sp, pattern="neurons", sparsity=s), _step(q)), stage=2, needs="sparsify-neurons")
                  for s in (0.125, 0.25)]
        if "early-exit" in fam and classifier:
            c.append(Candidate("int8+early-exit", "no-padding-removal", (_step(q), _step("early-exit")),
                               stage=2, needs="early-exit"))
        if provider == "cpu":  # measured slower than int8 on MiniLM (docs/benchmarks.md): last
            c.append(Candidate("int4-rtn", "default", (_step(q, mode="int4", int4_method="rtn"),), stage=2))
    return c, notes


def _is_classifier(model: ir.Model) -> bool:
    outs = model.graph.outputs
    return len(outs) == 1 and outs[0].shape is not None and len(outs[0].shape) == 2
