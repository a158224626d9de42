"""The parity gate: PyTorch and ONNX Runtime on the same feeds, compared mask-aware.

The feeds include a right-padded batch of mixed lengths; positions the attention mask marks as
padding are left out (``graphopt.data.metrics.compare``), so the gate measures real tokens only.
An output whose ``max_abs`` exceeds ``atol`` fails the gate with :class:`ParityError`.

Default tolerances: ``1e-4`` for fp32 exports; ``1e-2`` for fp16 (the fp16 graph is compared against
the fp32 PyTorch model, so the number includes fp16 rounding of weights and activations).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from graphopt.data import metrics
from graphopt.errors import ParityError
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)

DEFAULT_ATOL = {"fp32": 1e-4, "fp16": 1e-2}


@dataclasses.dataclass
class OutputParity:
    """Numbers for one output over all parity feeds (real positions only)."""

    name: str
    max_abs: float
    cosine: float
    cosine_min: float
    samples: int
    passed: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ParityResult:
    """Per-output parity and the tolerance applied."""

    atol: float
    outputs: list[OutputParity]
    feeds: list[str]  # one short description per feed, e.g. "input_ids[3x16] (padded)"

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    def as_dict(self) -> dict:
        return {"atol": self.atol, "passed": self.passed, "feeds": self.feeds,
                "outputs": [o.as_dict() for o in self.outputs]}


def torch_outputs(module, feeds: Sequence[dict[str, np.ndarray]], input_names: Sequence[str],
                  output_names: Sequence[str]) -> list[dict[str, np.ndarray]]:
    """Run the torch module (positional inputs) on each feed; float outputs as float32 numpy."""
    import torch

    results = []
    with torch.no_grad():
        for feed in feeds:
            args = tuple(torch.from_numpy(np.ascontiguousarray(feed[n])) for n in input_names)
            outs = module(*args)
            results.append({n: _np(t) for n, t in zip(output_names, outs, strict=True)})
    return results


def _np(t) -> np.ndarray:
    a = t.detach().cpu()
    if a.is_floating_point():
        a = a.float()
    return a.numpy()


def _describe(feed: dict[str, np.ndarray]) -> str:
    ids = feed.get("input_ids")
    if ids is None:
        first = next(iter(feed.items()))
        return f"{first[0]}{list(first[1].shape)}"
    mask = feed.get("attention_mask")
    padded = mask is not None and mask.ndim == 2 and bool((mask == 0).any())
    return f"input_ids[{'x'.join(map(str, ids.shape))}]" + (" padded" if padded else "")


def check(model, reference, feeds, input_names, output_names, *, atol: float, fp16_inputs: bool = False,
          src: str = "model") -> ParityResult:
    """Compare ORT on ``model`` (onnx_ir.Model or path) with ``reference`` (torch); raise on failure."""
    ref = torch_outputs(reference, feeds, input_names, output_names)
    ort_feeds = feeds
    if fp16_inputs:
        ort_feeds = [{k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in f.items()} for f in feeds]
    sess = runtime.make_session(model)
    got = runtime.run(sess, ort_feeds, outputs=output_names)
    cmp = metrics.compare(got, ref, feeds, atol=atol, rtol=0.0, outputs=output_names)
    outs = []
    for name in output_names:
        d = cmp.outputs[name]
        if d.shape_mismatch:
            raise ParityError(f"{src}: output {name!r} shape differs from PyTorch: {d.shape_mismatch}",
                              hint="a dynamic axis may have been fixed at export; try --exporter torchscript")
        ok = bool(d.max_abs <= atol) and not np.isnan(d.max_abs)
        outs.append(OutputParity(name, d.max_abs, d.cosine, d.cosine_min, d.samples, ok))
    result = ParityResult(atol=atol, outputs=outs, feeds=[_describe(f) for f in feeds])
    for o in outs:
        logger.info("parity %s: max_abs %.3g cosine %.8f (%d samples)", o.name, o.max_abs, o.cosine, o.samples)
    bad = [o for o in outs if not o.passed]
    if bad:
        o = max(bad, key=lambda x: x.max_abs)
        err = ParityError(
            f"{src}: output {o.name!r} differs from PyTorch: max_abs {o.max_abs:.3g} > atol {atol:g} "
            f"(cosine {o.cosine:.6f}, {o.samples} real positions)",
            hint="try the other --exporter or --attn, or loosen --atol if the difference is acceptable",
        )
        err.result = result
        raise err
    return result
