"""``early-exit``: confidence-gated adaptive depth for classifiers, as nested ``If`` nodes (lossy).

Exit heads are fitted after chosen transformer layers by self-distillation to the model's own final
logits on the calibration feeds (no labels); each exit checks a confidence criterion and, when it
holds, returns its head's logits without running the remaining layers (an ``If`` runs only the branch
it takes)::

    ... layer k --h_k--> head_k --logits_k--> confident_k --If--then--> logits_k
                                                           \\--else--> layer k+1 ... head_k2 --If--then/else--> ...
                                                                                         (last else: the original layers and head)

Layer boundaries are found from the graph itself, not from names: in topological order, a
normalization output (``LayerNormalization``, ``SkipLayerNormalization`` / ``EmbedLayerNormalization``
output 0, ``SimplifiedLayerNormalization``) is a *cut* when it is the only value of its shape
(rank and hidden size) computed before it and still used after it -- the whole residual stream passes
through it. A cut opens a layer when the stretch up to the next cut holds an attention (``Softmax`` or an
attention contrib op); the layer outputs are the cuts that open layers 2..N plus the last cut. The
post-LN encoders of BERT/MiniLM (TorchScript or dynamo, fused or not, quantized or not) have them;
pre-LN graphs (the residual bypasses the norms) do not, and the pass refuses naming what it found.

Exit heads pool ``h_k`` as the model's own head pools the last layer output: ``pool=auto`` (the
default) reads it from the graph between the last layer and the logits (``pooling.read_pooling``: the
first token, the masked mean, the max over tokens or the last token; the notes say which) and falls back
to ``cls+mean`` (both concatenated) when it finds none; ``cls``, ``mean``, ``max``, ``last`` and
``cls+mean`` ask for one. Heads are one of: ``linear`` (ridge regression to the final logits), ``logistic``
(soft-target multinomial regression) or ``mlp`` (one tanh hidden layer, soft targets); each gets a
softmax temperature fitted on held-back rows. ``head=auto`` picks, per exit, the kind that agrees best
with the full model on rows not used to fit it.

Calibration rows (every row of ``ctx.calib_feeds``) are split 2:1:2: *fit* (heads), *tune*
(temperature, head choice, candidate thresholds, the cost of each) and *confirm* (certification). A
threshold is certified when its argmax agreement with the full model on the confirm rows has a
one-sided Clopper-Pearson lower bound at ``confidence`` (default 0.95; 0 = the plain agreement) that
reaches the budget's ``top1``; candidates are tested strictest first up to the first failure (a
fixed-sequence test) and the cheapest certified one is taken. Before any of that the pass computes how
many error-free confirm rows the budget needs (``top1>=0.99`` at 0.95: 299) and refuses, naming that
number, the confirm rows it has and the best ``top1`` they can certify, when there are too few. Criteria: ``maxprob`` (max softmax probability >=
t; the graph and the calibration compare its log-odds, ``s_max - logsumexp(s_j, j != argmax)`` of the
tempered logits ``s``, which never round to 1.0, so very confident rows still rank), ``entropy`` (1 - entropy/log(classes) >= t, DeeBERT) and ``patience`` (the last ``t`` exits agree
on the class, PABEE).

The weights that only a branch's layers read become that branch's initializers (ONNX Runtime prepacks
a kernel's own graph's constants only; read from the outer scope, nested layers ran about 2x slower).

``mode=batch``: a batch exits when every row is confident. ``mode=row``: confident rows leave; the
others are ``Compress``-ed out of every batch-indexed value the rest of the graph reads, run deeper,
and their results are ``ScatterND``-ed back in the original order. ``exit_output=NAME`` adds an int64
``[batch]`` output with each row's exit layer (N = the full model).

Order: run after ``fuse`` and ``quantize`` (``run_after``): fusion and quantization then happen
before the layers move into the branches. ``remove-padding`` packs tokens of all rows into one
sequence, so layers have no batch axis to gate: the pass refuses a packed graph (run
``remove-padding`` without ``early-exit``), and ``remove-padding`` refuses a graph with ``If`` nodes.
(It also refuses first-token pooling, so classifiers like the MiniLM sentiment model never pack.)

Refuses (graph unchanged, ``budget_met=False`` where a budget could not be met, the reason and the
per-exit fidelity table in the notes): no layer boundaries; more than one graph output; an output that
is not class logits ``[batch, classes]`` (e.g. an embedding model: the table shows each exit's
achievable cosine / top1 with a per-token linear map); too few calibration rows; no exit meets the budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from graphopt import PASS_TAG
from graphopt.data import metrics
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.rewrites.common import lossy
from graphopt.rewrites.common.bounds import agreement_lower_bound
from graphopt.rewrites.early_exit import thresholds
from graphopt.rewrites.early_exit.graph import Builder, Exit, mask_input
from graphopt.rewrites.early_exit.heads import Head, fit_head, fit_temperature, pool_features
from graphopt.rewrites.early_exit.layers import find_layers
from graphopt.rewrites.early_exit.pooling import read_pooling
from graphopt.rewrites.early_exit.thresholds import budget_target, calibrate, confidence, simulate
from graphopt.runtime import session as runtime

logger = logging.getLogger(__name__)

CRITERIA = ("maxprob", "entropy", "patience")
MODES = ("batch", "row")
HEADS = ("auto", "linear", "logistic", "mlp")
POOLS = ("auto", "cls", "mean", "max", "last", "cls+mean")
#: fewest calibration rows the pass accepts (fit / tune / confirm need some each)
MIN_ROWS = 24


# ------------------------------------------------------------------ the pass


class EarlyExitPass(GraphoptPass):
    """Early exit for classifiers: exit heads after chosen layers, nested If branches, thresholds under a top1 budget."""

    name = "early-exit"
    exact = False
    run_after = ("cleanup", "fuse", "quantize")
    default_budget = "top1>=0.99"

    def __init__(self, *, layers: str = "", criterion: str = "maxprob", threshold: float = -1.0,
                 mode: str = "batch", head: str = "auto", pool: str = "auto", exit_output: str = "",
                 min_layer: int = 1, seed: int = 0, confidence: float = 0.95):
        super().__init__()
        for opt, val, allowed in (("criterion", criterion, CRITERIA), ("mode", mode, MODES),
                                  ("head", head, HEADS), ("pool", pool, POOLS)):
            if val not in allowed:
                raise UsageError(f"early-exit.{opt} must be one of {', '.join(allowed)}, got {val!r}")
        try:
            self.layer_list = tuple(int(x) for x in str(layers).replace(" ", "").split(",") if x)
        except ValueError:
            raise UsageError(f"early-exit.layers takes layer numbers like '2,4', got {layers!r}") from None
        if any(k < 1 for k in self.layer_list):
            raise UsageError(f"early-exit.layers are 1-based layer numbers, got {layers!r}")
        if min_layer < 1:
            raise UsageError(f"early-exit.min_layer must be >= 1, got {min_layer}")
        if not 0.0 <= confidence < 1.0:
            raise UsageError(f"early-exit.confidence must be in [0, 1), got {confidence}")
        self.confidence = float(confidence)
        self.layers = layers
        self.criterion = criterion
        self.threshold = float(threshold)
        self.mode = mode
        self.head = head
        self.pool = pool
        self.exit_output = exit_output
        self.min_layer = min_layer
        self.seed = seed

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        return _Run(self, model, ctx, lossy.BudgetSearch.of(self, ctx)).run()


@dataclasses.dataclass
class _Run:
    """State of one ``call``."""

    p: EarlyExitPass
    model: ir.Model
    ctx: PassContext
    #: the budget and the notes
    s: lossy.BudgetSearch
    #: the pooling the exit heads use (``pool``, or what the graph shows for ``auto``)
    pool: str = ""

    @property
    def budget(self) -> metrics.Budget:
        return self.s.budget

    @property
    def notes(self) -> list[str]:
        return self.s.notes

    def refuse(self, why: str, budget_met: bool | None = None) -> PassResult:
        self.notes.insert(0, f"not applied: {why}")
        return self.s.result(self.model, False, met=budget_met)

    def run(self) -> PassResult:
        g = self.model.graph
        if any(n.op_type == "If" and n.domain == "" for n in g):
            return self.refuse("the graph already has If nodes (early-exit ran already?)")
        if any(n.metadata_props.get(PASS_TAG) == "remove-padding" or (n.name or "").endswith("_packed") for n in g):
            return self.refuse("the graph was packed by remove-padding (the tokens of all rows in one sequence: "
                               "no batch axis to gate); run remove-padding without early-exit")
        layers, why = find_layers(g)
        if not layers:
            return self.refuse(why)
        batch_dim = self._batch_dim()
        if batch_dim is None:
            return self.refuse("the graph inputs have no common batch dimension")
        if any(v.shape is None or v.shape[0] != batch_dim for v in layers):
            return self.refuse(f"the layer outputs ('{layers[0].name}' {layers[0].shape}) have no batch axis: "
                               "the tokens are packed (remove-padding); run remove-padding without early-exit")
        if len(g.outputs) != 1:
            return self.refuse(f"early-exit needs one graph output, this graph has {len(g.outputs)}")
        out = g.outputs[0]
        n_layers = len(layers)
        self.notes.append(f"layers: {n_layers} found (outputs of {', '.join(repr(v.name) for v in layers)})")
        self.pool = self.p.pool
        if self.pool == "auto":
            read, how = read_pooling(g, layers[-1], out)
            self.pool = read or "cls+mean"
            self.notes.append(f"pooling: {read} (read from the graph: {how})" if read else
                              f"pooling: cls+mean ({how}; pool=auto falls back to both)")
        else:
            self.notes.append(f"pooling: {self.pool} (pool={self.pool})")
        wanted = list(self.p.layer_list) or list(range(self.p.min_layer, n_layers))
        bad = [k for k in wanted if k >= n_layers]
        if bad:
            return self.refuse(f"layers={self.p.layers!r}: exits must be after layers 1..{n_layers - 1}")
        if not wanted:
            return self.refuse(f"no exit layer left (min_layer={self.p.min_layer}, {n_layers} layers)")
        feeds = list(self.ctx.calib_feeds)
        if not feeds:
            return self.refuse("no calibration feeds")
        hs, final, masks = self._collect([layers[k - 1] for k in wanted], out, feeds)
        rows = final.shape[0]
        if rows < MIN_ROWS:
            return self.refuse(f"{rows} calibration rows; early-exit needs at least {MIN_ROWS}")
        rng = np.random.default_rng(self.p.seed)
        order = rng.permutation(rows)
        fit, tune, confirm = order[: rows * 2 // 5], order[rows * 2 // 5 : rows * 3 // 5], order[rows * 3 // 5 :]
        classifier = final.ndim == 2 and final.shape[1] >= 2 and out.shape is not None and len(out.shape) == 2
        if not classifier:
            return self._refuse_embeddings(hs, final, masks, wanted, fit, tune)
        target = budget_target(self.budget)
        if target is None:
            return self.refuse(f"budget {self.budget} has no top1 term; early-exit calibrates class agreement "
                               "(e.g. --budget 'top1>=0.99')")
        if self.p.threshold < 0:
            need = thresholds.rows_needed(target, self.p.confidence)
            if len(confirm) < need:
                best = agreement_lower_bound(len(confirm), len(confirm), self.p.confidence)
                return self.refuse(
                    f"top1>={target:g} needs >= {need} confirm rows at {self.p.confidence:g} confidence; the "
                    f"calibration data gives {len(confirm)} confirm rows ({rows} rows, 2/5 of them to "
                    f"confirm), which can certify at most top1>={best:.4f} (about {math.ceil(need * 5 / 2)} "
                    "calibration rows needed, or a lower top1 budget / confidence)" + self._held_hint(need),
                    budget_met=False)
        feats = [pool_features(h, masks, self.pool) for h in hs]
        labels = final.argmax(-1)
        exits, table = [], []
        for k, x in zip(wanted, feats):
            head, agree = self._best_head(x, final, fit, tune)
            exits.append((k, head))
            table.append(f"layer {k}: {head.kind} head, T={head.temperature:.2f}, top1 {agree:.4f} (tune, every row exits)")
        self.notes.append("fidelity per exit: " + "; ".join(table))
        preds = np.stack([h.logits(x).argmax(-1) for (_, h), x in zip(exits, feats)])
        scores = np.stack([confidence(h.logits(x), h.temperature, self.p.criterion) for (_, h), x in zip(exits, feats)])
        layer_of = np.array([k for k, _ in exits] + [n_layers])
        if self.p.threshold >= 0:
            threshold = thresholds.score_threshold(self.p.threshold, self.p.criterion)
        else:
            threshold = calibrate(preds, scores, labels, layer_of, target, tune, confirm, n_layers,
                                  criterion=self.p.criterion, confidence=self.p.confidence, note=self.notes.append)
            if threshold is None:
                return self.refuse(f"no threshold meets {self.budget} on the confirm rows (lower bound at "
                                   f"confidence {self.p.confidence:g}, {len(confirm)} rows) with an early exit; "
                                   + "; ".join(table), budget_met=False)
        measured: dict[str, float] = {}
        for part, idx in (("tune", tune), ("confirm", confirm)):
            ex, pr = simulate(preds[:, idx], scores[:, idx], labels[idx], self.p.criterion, threshold)
            measured["top1"] = float(np.mean(pr == labels[idx]))  # the confirm rows' (held back from the choice)
            hist = np.bincount(ex, minlength=len(exits) + 1)
            lb = agreement_lower_bound(int(np.sum(pr == labels[idx])), len(idx), self.p.confidence)
            self.notes.append(
                f"{part}: top1 {np.mean(pr == labels[idx]):.4f} (lower bound {lb:.4f}), mean exit layer {layer_of[ex].mean():.2f}/{n_layers} "
                f"(ideal {n_layers / layer_of[ex].mean():.2f}x), exits " +
                ", ".join(f"L{layer_of[j]}:{hist[j]}" for j in range(len(hist))))
        # used exits only (a never-used exit costs a head and an If)
        ex_all, _ = simulate(preds, scores, labels, self.p.criterion, threshold)
        used = set(ex_all.tolist())
        keep = [j for j in range(len(exits)) if j in used or self.p.layer_list or self.p.threshold >= 0]
        if self.p.criterion == "patience":
            keep = list(range(len(exits)))
        chosen = [Exit(exits[j][0], layers[exits[j][0] - 1], exits[j][1]) for j in keep]
        if not chosen:
            return self.refuse(f"threshold {self._shown(threshold)} makes no row exit early on calibration",
                               budget_met=None)
        why = Builder(self.p, self.model, batch_dim, n_layers, threshold, self.pool).build(chosen)
        if why:
            return self.refuse(why)
        self.notes.append(f"{self.p.criterion} threshold {self._shown(threshold)}, mode {self.p.mode}, exits after layers "
                          + ", ".join(str(e.layer) for e in chosen))
        counts = {"exit": len(chosen), "If": len(chosen)}
        return self.s.result(self.model, True, met=True, held=measured, rule_counts=counts)

    # -- helpers

    def _held_hint(self, need: float) -> str:
        """Where the rows came from: optimize --calib hands a pass the first half of the feeds."""
        if not self.ctx.feeds or self.ctx.feeds is self.ctx.calib_feeds:
            return ""
        held = sum(int(np.asarray(next(iter(f.values()))).shape[0]) for f in self.ctx.feeds if f)
        return (f"; optimize --calib calibrates on the first half of the feeds (the other {held} rows check the "
                f"budget): a folder of about {math.ceil(need * 5)} rows")

    def _shown(self, threshold: float) -> str:
        if self.p.criterion != "maxprob":
            return f"{threshold:g}"
        p = thresholds.probability(threshold, "maxprob")
        shown = f"{p:.6g}" if p < 0.999 else f"1 - {math.exp(-threshold):.3g}" if math.isfinite(threshold) else "1"
        return f"{threshold:g} (log-odds; max probability {shown})"

    def _batch_dim(self):
        dims = [v.shape[0] for v in self.model.graph.inputs if v.shape is not None and len(v.shape) >= 1]
        return dims[0] if dims and all(d == dims[0] for d in dims) else None

    def _collect(self, values: list[ir.Value], out: ir.Value, feeds: Sequence[Mapping[str, np.ndarray]]):
        """Run the model once with the layer outputs exposed: (hidden states per exit, final output, masks)."""
        g = self.model.graph
        extra = [v for v in values if v not in g.outputs]
        for v in extra:
            g.outputs.append(v)
        try:
            sess = runtime.make_session(self.model, optimize=True)
        finally:
            for _ in extra:
                g.outputs.pop()
        names = [v.name for v in values] + [out.name]
        mask = mask_input(self.model)
        mask_name = mask.name if mask is not None else None
        per = [[] for _ in names]
        masks = []
        for res, feed in zip(runtime.run(sess, feeds, outputs=names), feeds):
            b = res[out.name].shape[0]
            s = max(r.shape[1] for n, r in res.items() if n != out.name) if len(values) else 0
            for i, n in enumerate(names):
                a = res[n]
                if a.ndim == 3 and a.shape[1] < s:  # pad the sequence axis so batches stack
                    a = np.pad(a, ((0, 0), (0, s - a.shape[1]), (0, 0)))
                per[i].append(a)
            m = np.asarray(feed[mask_name]) if mask_name and mask_name in feed else np.ones((b, s), np.int64)
            masks.append(np.pad(m, ((0, 0), (0, s - m.shape[1]))))
        width = max(a.shape[1] for a in masks)

        def cat(arrs):
            if arrs[0].ndim >= 2 and any(a.shape[1] != arrs[0].shape[1] for a in arrs):
                arrs = [np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in arrs]
            return np.concatenate(arrs, 0)

        hs = [cat(a) for a in per[:-1]]
        return hs, cat(per[-1]), cat(masks)

    def _best_head(self, x: np.ndarray, z: np.ndarray, fit: np.ndarray, tune: np.ndarray) -> tuple[Head, float]:
        kinds = ("linear", "logistic", "mlp") if self.p.head == "auto" else (self.p.head,)
        labels = z.argmax(-1)
        best, best_agree = None, -1.0
        for kind in kinds:
            head = fit_head(kind, x[fit], z[fit], self.p.seed)
            lt = head.logits(x[tune])
            head.temperature = fit_temperature(lt, labels[tune])
            agree = float(np.mean(lt.argmax(-1) == labels[tune]))
            if agree > best_agree + 1e-9:
                best, best_agree = head, agree
            if best_agree >= 1.0:  # a simpler kind already agrees on every tune row
                break
        return best, best_agree

    def _refuse_embeddings(self, hs, final, masks, wanted, fit, tune) -> PassResult:
        """Per exit: a per-token linear map to the final output, its fidelity on the tune rows."""
        rows = []
        met = []
        for k, h in zip(wanted, hs):
            if final.ndim == 3 and h.shape[:2] == final.shape[:2]:
                m = masks[fit].astype(bool)
                xf, yf = h[fit][m], final[fit][m]
                xa = np.concatenate([xf, np.ones((len(xf), 1), np.float32)], 1).astype(np.float64)
                wb = np.linalg.solve(xa.T @ xa + 1e-2 * len(xf) * np.eye(xa.shape[1]), xa.T @ yf)
                got = (np.concatenate([h[tune], np.ones(h[tune].shape[:2] + (1,), np.float32)], -1) @ wb)
                got = got.astype(np.float32)
            else:
                x = pool_features(h, masks, self.pool)
                flat = final.reshape(final.shape[0], -1)
                head = fit_head("linear", x[fit], flat[fit])
                got = head.logits(x[tune]).reshape((len(tune),) + final.shape[1:])
            cmp = metrics.compare([{"y": got}], [{"y": final[tune]}], [{"attention_mask": masks[tune]}])
            d = cmp.outputs["y"]
            rows.append(f"layer {k}: cosine {d.cosine:.4f}, cosine_min {d.cosine_min:.4f}, top1 {d.top1:.4f}")
            if not self.budget.failures(cmp):
                met.append(k)
        table = "; ".join(rows)
        if met:
            return self.refuse(f"the output is not class logits [batch, classes]: exits after layers {met} "
                               f"would meet {self.budget} but early-exit has no confidence criterion for "
                               f"such outputs; fidelity per exit (linear map): {table}")
        return self.refuse(f"the output is not class logits and no exit meets {self.budget}; fidelity per exit "
                           f"(linear map, every row exits): {table}", budget_met=False)



register(EarlyExitPass)
