"""``prune-heads``: remove attention heads ranked by measured importance, with compensation (lossy).

Works on fused attention (``fuse``: com.microsoft ``Attention`` with a packed QKV weight, or
``MultiHeadAttention`` fed by separate Q/K/V MatMuls), also after ``remove-padding`` (every
length-group copy of a layer changes together) and with ``--provider cuda``'s
``PackedMultiHeadAttention``; and on unfused attention (all four MiniLM exports: TorchScript/dynamo,
eager/sdpa; ``unfused.py``: Q/K/V MatMuls + bias Adds, head-split Reshapes, MatMul/Softmax/MatMul, head
merge). See ``layers.py`` for the fused subgraph::

    x --[W_q|W_k|W_v]--> Attention/MHA (num_heads n) --ctx [.., n*d]--> MatMul(W_o) --> +bias, residual

1. Importance per head on calibration feeds (``importance=``):
   ``ablation`` (default): the budget metric's loss with that head's context zeroed, all 12*L
   ablations in one session of a *probe model* (``probe.py``: each output projection reads
   ``ctx * mask``, so an ablation is a change of feeds); ``local``: a first-order estimate from one run,
   the head's share of its layer's projected output energy ``|ctx_h W_o,h|^2 / |ctx W_o|^2`` (the
   change of the residual stream, downstream layers taken as linear); ``random`` (``seed``) for
   comparisons. Heads are ranked globally; each layer keeps ``min_heads``. ``iterative=N`` (ablation
   only; off by default: on MiniLM most of its gain came from ranking with compensation, which one round
   with N >= the heads removed also gives; re-ranking itself helped only at 37.5%, for 4.5x the ranking
   time, docs/benchmarks.md) re-ranks after every N removed
   heads, ablating each remaining head on top of those already chosen (compensated when compensation is
   on).
2. Compensation (``compensate=true``): each pruned layer's output projection and bias are re-fit by
   least squares (closed form) so ``ctx_kept W' + c`` matches ``ctx W_o`` on the calibration tokens
   (contexts of the unpruned model), each token weighted by ``1 / |ctx W_o|^2`` (relative error per
   token: unweighted, a few tokens with small outputs, [SEP] among them, lost most of their cosine on
   MiniLM) with a ridge on the change of ``W_o`` (``RIDGE`` times the mean Gram diagonal; a layer with
   fewer calibration tokens than twice its unknowns is not re-fit).
3. How many go: ``heads=N`` or ``ratio=R`` (of all heads), else the budget: the most heads whose probe
   model meets the budget on the calibration feeds (binary search), then confirmed on the held-back
   feeds (fewer heads while it fails there). ``budget_share=S`` spends only ``S`` of the budget's slack
   (``cosine>=0.99`` at 0.5 is ``cosine>=0.995``), leaving the rest to a later lossy pass (quantize).
4. Physical removal: the kept heads' Q/K/V columns and W_o rows are sliced, ``num_heads`` (and
   ``qkv_hidden_sizes``) set, constant Reshapes on the context path ``[..., H]`` rewritten; unfused: the
   three projection MatMuls and bias Adds sliced, constant Reshape shapes with ``n`` / ``H`` rewritten
   (``-1`` and computed entries, as the exporters write them, need nothing).

Refuses (model unchanged, the reason in the notes): no attention (fused or MatMul/Softmax/MatMul with
constant projections), an unfused Reshape that computes its shape with a constant head count or width
(Concat of computed dims and ``[n, d]``), quantized attention (run prune-heads before quantize), causal/rotary/past-state attention,
packed QKV inputs, a context that reaches anything but an output projection through
Reshape/Concat/Gather/Squeeze, projections without constant weights.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt.data.metrics import Comparison, compare, find_mask
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.rewrites.common import lossy
from graphopt.rewrites.prune_heads import layers as layers_mod
from graphopt.rewrites.prune_heads import probe as probe_mod
from graphopt.rewrites.prune_heads.attention import Layer, Refusal
from graphopt.runtime import standins

logger = logging.getLogger(__name__)

DEFAULT_BUDGET = "cosine>=0.98"
IMPORTANCE = ("ablation", "local", "random")
FLOP_SEQ = 128
#: ridge of the compensation fit, relative to the mean diagonal of the kept contexts' Gram matrix
RIDGE = 0.1


class PruneHeadsPass(GraphoptPass):
    """Remove the least important attention heads (ablation-ranked, least-squares compensated) under a budget."""

    name = "prune-heads"
    exact = False
    default_budget = DEFAULT_BUDGET
    run_after = ("fuse",)

    def __init__(self, *, ratio: float = 0.0, heads: int = 0, importance: str = "ablation",
                 compensate: bool = True, min_heads: int = 1, rank_feeds: int = 2, seed: int = 0,
                 budget_share: float = 1.0, iterative: int = 0):
        super().__init__()
        if iterative < 0 or (iterative and importance != "ablation"):
            raise UsageError("prune-heads.iterative=N (heads removed per re-ranking round) needs importance=ablation "
                             f"and N >= 0, got {iterative} with {importance}")
        if importance not in IMPORTANCE:
            raise UsageError(f"prune-heads.importance must be one of {', '.join(IMPORTANCE)}, got {importance!r}")
        if not 0.0 <= ratio < 1.0:
            raise UsageError(f"prune-heads.ratio must be in [0, 1), got {ratio}")
        if heads < 0 or (heads and ratio):
            raise UsageError("prune-heads: give heads=N or ratio=R (not both), or neither to follow the budget")
        if min_heads < 1:
            raise UsageError(f"prune-heads.min_heads must be >= 1, got {min_heads}")
        if not 0.0 < budget_share <= 1.0:
            raise UsageError(f"prune-heads.budget_share must be in (0, 1], got {budget_share}")
        self.ratio, self.heads, self.importance = float(ratio), int(heads), importance
        self.compensate, self.min_heads = bool(compensate), int(min_heads)
        self.rank_feeds, self.seed, self.budget_share = int(rank_feeds), int(seed), float(budget_share)
        self.iterative = int(iterative)

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        try:
            layers = layers_mod.find_layers(model)
        except Refusal as e:
            return PassResult(model, False, notes=[f"not applied: {e}"])
        s = lossy.BudgetSearch.of(self, ctx, budget_share=self.budget_share, default_note=True, log=False)
        s.rows(model, ctx, "ranking", log=False)
        return _Run(self, model, layers, s).go()


def _loss(c: Comparison) -> float:
    return (1.0 - c.worst("cosine")) + 0.25 * (1.0 - c.worst("cosine_min"))


@dataclasses.dataclass
class _Fit:
    """Per layer: the Gram matrix of ``[ctx, 1]`` on calibration tokens and ``[ctx, 1]^T ctx W_o``."""

    gram: np.ndarray
    cross: np.ndarray
    energy: np.ndarray  # per head: sum over tokens of |ctx_h W_o,h|^2
    total: float
    rows: int
    wgram: np.ndarray  # the Gram matrix with token rows weighted for the fit


@dataclasses.dataclass
class _Run:
    """One call of the pass (made fresh by every ``call``; nothing of it stays on the pass)."""

    opts: PruneHeadsPass
    model: ir.Model
    layers: list[Layer]
    #: the budget, calibration / held-back rows, references and notes
    s: lossy.BudgetSearch

    def note(self, msg: str) -> None:
        self.s.note(msg)

    @property
    def calib(self) -> list[Mapping[str, np.ndarray]]:
        return self.s.calib

    @property
    def held(self) -> list[Mapping[str, np.ndarray]]:
        return self.s.held

    # ------------------------------------------------------------ setup

    def prepare(self) -> None:
        """The probe session, reference outputs, calibration contexts' Gram matrices."""
        layers = self.layers
        names = _name_projections(self.model, layers)  # before the CPU copy, so the names carry over
        runnable, _ = standins.cpu_runnable(self.model)
        self.probe = probe_mod.build(runnable, names)
        self.full = [np.ones(la.hidden, np.float32) for la in layers]
        ref = self.probe.run(self.calib, self.full, contexts=True)
        self.fits = [self._fit(i, ref) for i in range(len(layers))]
        ctx_names = set(self.probe.contexts)
        self.s.ref_calib = [{k: v for k, v in r.items() if k not in ctx_names} for r in ref]
        self.s.ref_held = self.probe.run(self.held, self.full)

    def go(self) -> PassResult:
        opts, layers = self.opts, self.layers
        self.prepare()
        total = sum(la.num_heads for la in layers)
        if opts.iterative:
            limit = (min(opts.heads or int(round(opts.ratio * total)), total) if opts.heads or opts.ratio
                     else total)
            order = self.iterative_order(limit)
        else:
            order = self.order(self.importance())
        self.note(f"{len(layers)} attention layers, {total} heads ({', '.join(la.name() for la in layers[:2])}"
                  + (" ..." if len(layers) > 2 else "") + f"); importance {opts.importance}")
        if opts.heads or opts.ratio:
            k = min(opts.heads or int(round(opts.ratio * total)), len(order))
            chosen = order[:k]
            held = self.evaluate(chosen, self.held, self.s.ref_held, opts.compensate)
            budget_met = None
        else:
            k = self.search(order)
            chosen = order[:k]
            held = self.evaluate(chosen, self.held, self.s.ref_held, opts.compensate) if k else None
            if k and self.s.fails(held):
                self.note(f"{k} heads meet the budget on calibration but not on held-back feeds: searching there")
                k = self.search(order[:k - 1], self.held, self.s.ref_held)
                chosen = order[:k]
                held = self.evaluate(chosen, self.held, self.s.ref_held, opts.compensate) if k else None
            budget_met = k > 0
            if not k:
                self.note(f"budget {self.s.budget}: not even one head can go; model left unchanged")
                return self.s.result(self.model, False, met=False)
        if not chosen:
            self.note("no head to remove (heads=0 / ratio rounds to 0)")
            return self.s.result(self.model, False, met=budget_met, held=held)
        self.report(chosen, held, total)
        weights, biases = self.refit(chosen) if opts.compensate else (None, None)
        by_layer = _by_layer(chosen, len(layers))
        graph = self.model.graph
        for i, layer in enumerate(layers):
            if not by_layer[i]:
                continue
            keep = [h for h in range(layer.num_heads) if h not in by_layer[i]]
            ch = layer.channels(keep)
            w = (self.probe.out_weights[i] if weights is None or weights[i] is None else weights[i])[ch]
            layers_mod.prune_layer(graph, layer, keep, w, None if biases is None else biases[i])
        counts = {"prune-heads-removed": len(chosen),
                  "prune-heads-layers": sum(1 for h in by_layer if h)}
        return self.s.result(self.model, True, met=budget_met, held=held, rule_counts=counts)

    def _fit(self, i: int, ref: list[dict[str, np.ndarray]]) -> _Fit:
        layer, w = self.layers[i], self.probe.out_weights[i].astype(np.float64)
        h = layer.hidden
        gram = np.zeros((h + 1, h + 1))
        wgram = np.zeros((h + 1, h + 1))
        rows = 0
        w32 = w.astype(np.float32)
        for feed, r in zip(self.calib, ref):
            x = _rows(r[self.probe.contexts[i]], feed)
            rows += x.shape[0]
            x1 = np.concatenate([x, np.ones((x.shape[0], 1), x.dtype)], axis=1)
            gram += (x1.T @ x1).astype(np.float64)
            # rows weighted by 1 / |ctx W_o|^2: relative error per token (the budget's cosine is per token)
            norm = np.sum((x @ w32) ** 2, axis=1)
            wt = 1.0 / np.maximum(norm, 1e-6 * max(float(norm.mean()), 1e-30))
            wgram += ((x1 * wt[:, None].astype(x.dtype)).T @ x1).astype(np.float64)
        cross = gram[:, :h] @ w
        # |x_h W_h|^2 summed over tokens = trace(W_h^T (x_h^T x_h) W_h)
        d = layer.head_size
        energy = np.array([float(np.sum(w[c] * (gram[c, c] @ w[c])))
                           for c in (slice(j * d, (j + 1) * d) for j in range(layer.num_heads))])
        total = float(np.sum(w * cross[:h]))
        return _Fit(gram, cross, energy, total, rows, wgram)

    # ------------------------------------------------------------ ranking

    def importance(self) -> list[tuple[int, int, float]]:
        """(layer, head, score): a higher score is a more important head."""
        opts = self.opts
        out = []
        if opts.importance == "random":
            rng = np.random.default_rng(opts.seed)
            return [(i, h, float(rng.random())) for i, la in enumerate(self.layers) for h in range(la.num_heads)]
        if opts.importance == "local":
            return [(i, h, float(f.energy[h] / max(f.total, 1e-30)))
                    for i, f in enumerate(self.fits) for h in range(len(f.energy))]
        n = opts.rank_feeds if opts.rank_feeds > 0 else len(self.calib)
        feeds, ref = self.calib[:n], self.s.ref_calib[:n]
        for i, layer in enumerate(self.layers):
            for h in range(layer.num_heads):
                masks = [m.copy() for m in self.full]
                masks[i][h * layer.head_size:(h + 1) * layer.head_size] = 0.0
                out.append((i, h, _loss(compare(self.probe.run(feeds, masks), ref, feeds))))
        return out

    def iterative_order(self, limit: int) -> list[tuple[int, int]]:
        """Removal order re-ranked every ``iterative`` heads: each round ablates every remaining head on top of
        the heads already chosen (with compensation when it is on) and takes the ``iterative`` cheapest."""
        opts = self.opts
        n = opts.rank_feeds if opts.rank_feeds > 0 else len(self.calib)
        feeds, ref = self.calib[:n], self.s.ref_calib[:n]
        chosen: list[tuple[int, int]] = []
        left = [la.num_heads for la in self.layers]
        while len(chosen) < limit:
            scored = sorted((_loss(self.evaluate(chosen + [(i, h)], feeds, ref, opts.compensate)), i, h)
                            for i, la in enumerate(self.layers) for h in range(la.num_heads)
                            if (i, h) not in chosen and left[i] > opts.min_heads)
            if not scored:
                break
            taken = 0
            for _, i, h in scored:
                if taken == opts.iterative or len(chosen) == limit:
                    break
                if left[i] > opts.min_heads:
                    chosen.append((i, h))
                    left[i] -= 1
                    taken += 1
        return chosen

    def order(self, scores: list[tuple[int, int, float]]) -> list[tuple[int, int]]:
        """Heads in removal order (least important first); each layer keeps its ``min_heads`` best."""
        keep = set()
        for i in range(len(self.layers)):
            mine = sorted((s, h) for li, h, s in scores if li == i)
            keep.update((i, h) for _, h in mine[-self.opts.min_heads:])
        return [(i, h) for i, h, _ in sorted(scores, key=lambda t: (t[2], t[0], t[1])) if (i, h) not in keep]

    # ------------------------------------------------------------ evaluation

    def masks(self, chosen: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        masks = [m.copy() for m in self.full]
        for i, h in chosen:
            d = self.layers[i].head_size
            masks[i][h * d:(h + 1) * d] = 0.0
        return masks

    def refit(self, chosen: Sequence[tuple[int, int]]) -> tuple[list, list]:
        """Least-squares output projections (rows of removed heads 0) and bias changes per layer."""
        by_layer = _by_layer(chosen, len(self.layers))
        weights: list[np.ndarray | None] = []
        biases: list[np.ndarray | None] = []
        for i, layer in enumerate(self.layers):
            if not by_layer[i]:
                weights.append(None)
                biases.append(None)
                continue
            keep = [h for h in range(layer.num_heads) if h not in by_layer[i]]
            ch, gone = layer.channels(keep), layer.channels(by_layer[i])
            idx = np.concatenate([ch, [layer.hidden]])
            f = self.fits[i]
            w0 = self.probe.out_weights[i].astype(np.float64)
            if f.rows < 2 * len(idx):  # too few tokens to fit: no compensation for this layer
                weights.append(None)
                biases.append(None)
                continue
            # ridge on the change of W_o (not on W_o): with little data the fit stays near no compensation
            g = f.wgram[np.ix_(idx, idx)]
            lam = RIDGE * np.trace(g) / len(idx)
            rhs = f.wgram[np.ix_(idx, gone)] @ w0[gone]  # [ctx_kept, 1]^T (removed heads' projected output)
            theta = np.linalg.solve(g + lam * np.eye(len(idx)), rhs)
            w = np.zeros_like(w0)
            w[ch] = w0[ch] + theta[:-1]
            weights.append(w.astype(np.float32))
            biases.append(theta[-1].astype(np.float32))
        return weights, biases

    def evaluate(self, chosen, feeds, ref, compensate: bool) -> Comparison:
        weights, biases = self.refit(chosen) if compensate else (None, None)
        return compare(self.probe.run(feeds, self.masks(chosen), weights, biases), ref, feeds)

    def search(self, order: list[tuple[int, int]], feeds=None, ref=None) -> int:
        """The most heads (a prefix of ``order``) whose model meets the budget on ``feeds`` (calibration)."""
        feeds, ref = (self.calib, self.s.ref_calib) if feeds is None else (feeds, ref)
        return lossy.bisect(1, len(order), lambda k: self.s.meets(self.evaluate(order[:k], feeds, ref,
                                                                                 self.opts.compensate)),
                            last=True) or 0

    # ------------------------------------------------------------ report

    def report(self, chosen: list[tuple[int, int]], held: Comparison, total: int) -> None:
        def m(c: Comparison) -> str:
            return f"cosine {c.worst('cosine'):.5f} / min {c.worst('cosine_min'):.5f}"

        by_layer = _by_layer(chosen, len(self.layers))
        self.note(f"removed {len(chosen)} of {total} heads ({100.0 * len(chosen) / total:.1f}%): " + "; ".join(
            f"layer {i}: {len(hs)} of {self.layers[i].num_heads} ({', '.join(map(str, sorted(hs)))})"
            for i, hs in enumerate(by_layer) if hs))
        params = flops = 0
        for i, hs in enumerate(by_layer):
            layer = self.layers[i]
            d, dm = layer.head_size, layer.model_dim
            params += len(hs) * (3 * dm * d + 3 * d + d * dm)
            flops += len(hs) * (2 * (3 * dm * d + d * dm) + 4 * FLOP_SEQ * d)
        self.note(f"parameters removed {params:,}; FLOPs removed {flops / 1e6:.2f} M per token (sequence {FLOP_SEQ})")
        other = self.evaluate(chosen, self.held, self.s.ref_held, not self.opts.compensate)
        cal = self.evaluate(chosen, self.calib, self.s.ref_calib, self.opts.compensate)
        with_c, without = (held, other) if self.opts.compensate else (other, held)
        self.note(f"held-back: with compensation {m(with_c)}; without {m(without)}; "
                  f"calibration ({'with' if self.opts.compensate else 'without'}): {m(cal)}")


def _by_layer(chosen: Sequence[tuple[int, int]], n: int) -> list[set[int]]:
    out: list[set[int]] = [set() for _ in range(n)]
    for i, h in chosen:
        out[i].add(h)
    return out


def _rows(ctx: np.ndarray, feed: Mapping[str, np.ndarray]) -> np.ndarray:
    """The context's token rows [N, H]: real tokens only where the context is [B, S, H] like the mask."""
    mask = find_mask(feed)
    if mask is not None and ctx.ndim == 3 and ctx.shape[:2] == mask.shape:
        return ctx[mask.astype(bool)]
    return ctx.reshape(-1, ctx.shape[-1])


def _name_projections(model: ir.Model, layers: list[Layer]) -> list[str]:
    """Unique names of the layers' output projections (unnamed or duplicated ones are renamed)."""
    seen = {n.name for n in model.graph if n is not None}
    names = []
    for i, layer in enumerate(layers):
        mm = layer.out_matmul
        if not mm.name or sum(1 for n in model.graph if n.name == mm.name) > 1:
            base = f"prune_heads_out_proj_{i}"
            while base in seen:
                base += "_"
            mm.name = base
            seen.add(base)
        names.append(mm.name)
    return names


register(PruneHeadsPass)
