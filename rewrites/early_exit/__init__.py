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

Exit heads read pooled features of ``h_k`` (``pool``: the first token, the mask-weighted mean, or both
concatenated) and are one of: ``linear`` (ridge regression to the final logits), ``logistic``
(soft-target multinomial regression) or ``mlp`` (one tanh hidden layer, soft targets); each gets a
softmax temperature fitted on held-back rows. ``head=auto`` picks, per exit, the kind that agrees best
with the full model on rows not used to fit it.

Calibration rows (every row of ``ctx.calib_feeds``) are split in three: *fit* (heads), *tune*
(temperature, head choice, threshold) and *confirm*. The threshold is the cheapest one whose argmax
agreement with the full model meets the budget's ``top1`` on the tune rows with a safety margin: the
one-sided Clopper-Pearson lower bound at ``confidence`` (default 0.95; 0 = the plain tune agreement)
must reach the budget, so a few hundred tune rows cannot pass a threshold by luck; the plain agreement
must also hold on the confirm rows (else the next stricter one is tried). Criteria: ``maxprob`` (max softmax probability >=
t), ``entropy`` (1 - entropy/log(classes) >= t, DeeBERT) and ``patience`` (the last ``t`` exits agree
on the class, PABEE).

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
import onnx_ir.passes.common as common_passes

from graphopt import PASS_TAG
from graphopt.data import metrics
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError

logger = logging.getLogger(__name__)

CRITERIA = ("maxprob", "entropy", "patience")
MODES = ("batch", "row")
HEADS = ("auto", "linear", "logistic", "mlp")
POOLS = ("cls", "mean", "cls+mean")
_NORMS = {("", "LayerNormalization"), ("com.microsoft", "SkipLayerNormalization"),
          ("com.microsoft", "EmbedLayerNormalization"), ("", "RMSNormalization"),
          ("com.microsoft", "SimplifiedLayerNormalization"), ("com.microsoft", "SkipSimplifiedLayerNormalization")}
_ATTENTION = {"Softmax", "Attention", "MultiHeadAttention", "QAttention", "GroupQueryAttention",
              "PackedAttention", "PackedMultiHeadAttention"}
#: fewest calibration rows the pass accepts (fit / tune / confirm need some each)
MIN_ROWS = 24
_PREFIX = "early_exit"


# ------------------------------------------------------------------ layer boundaries


def find_layers(graph: ir.Graph) -> tuple[list[ir.Value], str]:
    """The residual-stream value after each transformer layer, in order, or ([], why not)."""
    nodes = list(graph)
    last_use: dict[int, int] = {}
    for i, n in enumerate(nodes):
        for v in n.inputs:
            if v is not None and v.producer() is not None:
                last_use[id(v)] = i
    outs = {id(v) for v in graph.outputs}

    def signature(v: ir.Value):
        if v.shape is None:
            return None
        return (len(v.shape), v.shape[-1] if len(v.shape) else None)

    cuts: list[tuple[int, ir.Value]] = []
    for i, n in enumerate(nodes):
        if (n.domain, n.op_type) not in _NORMS or not n.outputs or n.outputs[0].shape is None:
            continue
        h = n.outputs[0]
        if len(h.shape) != 3 or not (h.uses() or id(h) in outs):
            continue
        sig = signature(h)
        crossing = False
        for m in nodes[: i + 1]:
            for v in m.outputs:
                if v is h or signature(v) != sig:
                    continue
                if last_use.get(id(v), -1) > i or id(v) in outs:
                    crossing = True
                    break
            if crossing:
                break
        if not crossing:
            cuts.append((i, h))
    if len(cuts) < 3:
        return [], (f"found {len(cuts)} normalization outputs that carry the whole residual stream "
                    "(a post-LN encoder has two per layer plus the embeddings'); no layer boundaries")
    opens = []
    for j, (i, _h) in enumerate(cuts):
        end = cuts[j + 1][0] if j + 1 < len(cuts) else len(nodes)
        if any(m.op_type in _ATTENTION for m in nodes[i + 1 : end]):
            opens.append(j)
    if len(opens) < 2:
        return [], f"{len(cuts)} residual-stream cuts but {len(opens)} followed by attention; no layer boundaries"
    layers = [cuts[j][1] for j in opens[1:]]
    if opens[-1] != len(cuts) - 1:
        layers.append(cuts[-1][1])
    return layers, ""


# ------------------------------------------------------------------ numpy: features and heads


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def pool_features(h: np.ndarray, mask: np.ndarray | None, pool: str) -> np.ndarray:
    """Pooled ``[batch, F]`` features of hidden states ``[batch, seq, H]`` (as the graph computes them)."""
    parts = []
    if "cls" in pool:
        parts.append(h[:, 0, :])
    if "mean" in pool:
        m = np.ones(h.shape[:2], np.float32) if mask is None else mask.astype(np.float32)
        num = (h * m[:, :, None]).sum(1)
        parts.append(num / np.maximum(m.sum(1, keepdims=True), 1.0))
    return np.concatenate(parts, axis=1).astype(np.float32)


@dataclasses.dataclass
class Head:
    """An exit head: standardise, optional tanh hidden layer, linear output; ``temperature`` for the criterion."""

    kind: str
    mean: np.ndarray
    scale: np.ndarray
    layers: list[tuple[np.ndarray, np.ndarray]]
    temperature: float = 1.0

    def logits(self, x: np.ndarray) -> np.ndarray:
        z = (x - self.mean) * self.scale
        for i, (w, b) in enumerate(self.layers):
            z = z @ w + b
            if i + 1 < len(self.layers):
                z = np.tanh(z)
        return z.astype(np.float32)

    def folded(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Layers with the standardisation folded into the first one (what the graph holds)."""
        (w0, b0), rest = self.layers[0], self.layers[1:]
        w = (self.scale[:, None] * w0).astype(np.float32)
        b = (b0 - (self.mean * self.scale) @ w0).astype(np.float32)
        return [(w, b)] + [(a.astype(np.float32), c.astype(np.float32)) for a, c in rest]


def _adam_fit(x: np.ndarray, p: np.ndarray, hidden: int, l2: float, steps: int, seed: int) -> list:
    """Soft-target cross-entropy fit of a linear (hidden=0) or one-hidden-layer tanh network."""
    rng = np.random.default_rng(seed)
    f, c = x.shape[1], p.shape[1]
    dims = [f, hidden, c] if hidden else [f, c]
    params = []
    for a, b in zip(dims[:-1], dims[1:]):
        params += [rng.normal(0, 1 / math.sqrt(a), (a, b)).astype(np.float32), np.zeros(b, np.float32)]
    m = [np.zeros_like(q) for q in params]
    v = [np.zeros_like(q) for q in params]
    lr, b1, b2 = 0.02, 0.9, 0.999
    x, p = x.astype(np.float32), p.astype(np.float32)
    n = x.shape[0]
    for t in range(1, steps + 1):
        acts = [x]
        z = x
        for i in range(0, len(params), 2):
            z = z @ params[i] + params[i + 1]
            if i + 2 < len(params):
                z = np.tanh(z)
            acts.append(z)
        g = (_softmax(z) - p) / n
        grads = [None] * len(params)
        for i in range(len(params) - 2, -1, -2):
            grads[i] = acts[i // 2].T @ g + l2 * params[i]
            grads[i + 1] = g.sum(0)
            if i:
                g = (g @ params[i].T) * (1 - acts[i // 2] ** 2)
        for i, gr in enumerate(grads):
            m[i] = b1 * m[i] + (1 - b1) * gr
            v[i] = b2 * v[i] + (1 - b2) * gr * gr
            params[i] -= lr * (m[i] / (1 - b1**t)) / (np.sqrt(v[i] / (1 - b2**t)) + 1e-8)
    return [(params[i], params[i + 1]) for i in range(0, len(params), 2)]


def fit_head(kind: str, x: np.ndarray, z: np.ndarray, seed: int = 0) -> Head:
    """Fit an exit head of ``kind`` on features ``x`` to the teacher logits ``z``."""
    mean = x.mean(0)
    scale = 1.0 / (x.std(0) + 1e-6)
    xs = ((x - mean) * scale).astype(np.float64)
    if kind == "linear":
        lam = 1.0 * xs.shape[0]
        xa = np.concatenate([xs, np.ones((xs.shape[0], 1))], 1)
        reg = lam * np.eye(xa.shape[1])
        reg[-1, -1] = 0.0
        wb = np.linalg.solve(xa.T @ xa + reg, xa.T @ z.astype(np.float64))
        layers = [(wb[:-1], wb[-1])]
    elif kind == "logistic":
        layers = _adam_fit(xs, _softmax(z.astype(np.float64)), 0, 1e-3, 150, seed)
    elif kind == "mlp":
        layers = _adam_fit(xs, _softmax(z.astype(np.float64)), 32, 1e-3, 200, seed)
    else:
        raise ValueError(kind)
    return Head(kind, mean.astype(np.float32), scale.astype(np.float32), layers)


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """Softmax temperature minimising the negative log-likelihood of ``labels`` (grid search)."""
    best, best_t = np.inf, 1.0
    for t in np.exp(np.linspace(np.log(0.05), np.log(20.0), 60)):
        lp = np.log(_softmax(logits / t) + 1e-12)
        nll = -lp[np.arange(len(labels)), labels].mean()
        if nll < best:
            best, best_t = nll, float(t)
    return best_t


def confidence(logits: np.ndarray, temperature: float, criterion: str) -> np.ndarray:
    """Per-row confidence score (higher: more confident) as the graph computes it."""
    p = _softmax(logits.astype(np.float64) / temperature)
    if criterion == "entropy":
        ent = -(p * np.log(p + 1e-12)).sum(-1)
        return 1.0 - ent / math.log(p.shape[-1])
    return p.max(-1)


def simulate(preds: np.ndarray, scores: np.ndarray, final: np.ndarray, criterion: str, threshold: float,
             ) -> tuple[np.ndarray, np.ndarray]:
    """(exit index per row, prediction per row); index E (= number of exits) is the full model."""
    e, n = preds.shape
    exit_at = np.full(n, e)
    out = final.copy()
    undecided = np.ones(n, bool)
    for j in range(e):
        if criterion == "patience":
            t = int(threshold)
            if t < 1 or j + 1 < t:
                continue
            ok = np.all(preds[j - t + 1 : j + 1] == preds[j], axis=0)
        else:
            ok = scores[j] >= threshold
        hit = undecided & ok
        exit_at[hit] = j
        out[hit] = preds[j][hit]
        undecided &= ~hit
    return exit_at, out


# ------------------------------------------------------------------ the pass


def agreement_lower_bound(agree: int, rows: int, confidence: float) -> float:
    """One-sided Clopper-Pearson lower bound of an agreement rate (``agree`` of ``rows``) at ``confidence``.

    ``confidence=0`` gives the plain rate ``agree / rows``.
    """
    if rows <= 0:
        return 0.0
    if confidence <= 0.0:
        return agree / rows
    if agree <= 0:
        return 0.0
    from scipy.stats import beta

    return float(beta.ppf(1.0 - confidence, agree, rows - agree + 1))


def _budget_target(budget: metrics.Budget) -> float | None:
    for t in budget.terms:
        if t.metric == "top1" and t.op in (">=", ">"):
            return t.value
    return None


class EarlyExit(GraphoptPass):
    """Early exit for classifiers: exit heads after chosen layers, nested If branches, thresholds under a top1 budget."""

    name = "early-exit"
    exact = False
    run_after = ("cleanup", "fuse", "quantize")
    default_budget = "top1>=0.99"

    def __init__(self, *, layers: str = "", criterion: str = "maxprob", threshold: float = -1.0,
                 mode: str = "batch", head: str = "auto", pool: str = "cls+mean", exit_output: str = "",
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
        budget = ctx.budget if ctx.budget else metrics.parse_budget(self.default_budget)
        return _Run(self, model, ctx, budget).run()


@dataclasses.dataclass
class _Exit:
    layer: int  # 1-based
    value: ir.Value
    head: Head


@dataclasses.dataclass
class _Run:
    """State of one ``call``."""

    p: EarlyExit
    model: ir.Model
    ctx: PassContext
    budget: metrics.Budget
    notes: list[str] = dataclasses.field(default_factory=list)

    def refuse(self, why: str, budget_met: bool | None = None) -> PassResult:
        self.notes.insert(0, f"not applied: {why}")
        return PassResult(self.model, False, notes=self.notes, budget_met=budget_met)

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
        fit, tune, confirm = order[: rows // 2], order[rows // 2 : rows * 3 // 4], order[rows * 3 // 4 :]
        classifier = final.ndim == 2 and final.shape[1] >= 2 and out.shape is not None and len(out.shape) == 2
        if not classifier:
            return self._refuse_embeddings(hs, final, masks, wanted, fit, tune)
        target = _budget_target(self.budget)
        if target is None:
            return self.refuse(f"budget {self.budget} has no top1 term; early-exit calibrates class agreement "
                               "(e.g. --budget 'top1>=0.99')")
        feats = [pool_features(h, masks, self.p.pool) for h in hs]
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
            threshold = self.p.threshold
        else:
            threshold = self._calibrate(preds, scores, labels, layer_of, target, tune, confirm, n_layers)
            if threshold is None:
                return self.refuse(f"no threshold meets {self.budget} on both the tune rows (lower bound at "
                                   f"confidence {self.p.confidence:g}) and the confirm rows "
                                   f"({len(tune)}/{len(confirm)} rows); " + "; ".join(table), budget_met=False)
        for part, idx in (("tune", tune), ("confirm", confirm)):
            ex, pr = simulate(preds[:, idx], scores[:, idx], labels[idx], self.p.criterion, threshold)
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
        chosen = [_Exit(exits[j][0], layers[exits[j][0] - 1], exits[j][1]) for j in keep]
        if not chosen:
            return self.refuse(f"threshold {threshold:g} makes no row exit early on calibration", budget_met=None)
        why = _Builder(self, batch_dim, n_layers, threshold).build(chosen)
        if why:
            return self.refuse(why)
        self.notes.append(f"{self.p.criterion} threshold {threshold:g}, mode {self.p.mode}, exits after layers "
                          + ", ".join(str(e.layer) for e in chosen))
        counts = {"exit": len(chosen), "If": len(chosen)}
        return PassResult(self.model, True, notes=self.notes, rule_counts=counts, budget_met=True)

    # -- helpers

    def _batch_dim(self):
        dims = [v.shape[0] for v in self.model.graph.inputs if v.shape is not None and len(v.shape) >= 1]
        return dims[0] if dims and all(d == dims[0] for d in dims) else None

    def _mask_input(self) -> ir.Value | None:
        for v in self.model.graph.inputs:
            if v.name in metrics.MASK_NAMES and v.shape is not None and len(v.shape) == 2:
                return v
        return None

    def _collect(self, values: list[ir.Value], out: ir.Value, feeds: Sequence[Mapping[str, np.ndarray]]):
        """Run the model once with the layer outputs exposed: (hidden states per exit, final output, masks)."""
        from graphopt.runtime import session as runtime

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
        mask_name = self._mask_input().name if self._mask_input() is not None else None
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

    def _calibrate(self, preds, scores, labels, layer_of, target, tune, confirm, n_layers):
        if self.p.criterion == "patience":
            cands = [float(t) for t in range(1, preds.shape[0] + 1)]
        else:
            cands = sorted(set(np.round(np.quantile(scores[:, tune], np.linspace(0, 1, 201)), 6).tolist()))
            cands.append(1.0 + 1e-6)

        def stats(idx, t):
            ex, pr = simulate(preds[:, idx], scores[:, idx], labels[idx], self.p.criterion, t)
            return float(np.mean(pr == labels[idx])), float(layer_of[ex].mean())

        def bound(t):
            ex, pr = simulate(preds[:, tune], scores[:, tune], labels[tune], self.p.criterion, t)
            return agreement_lower_bound(int(np.sum(pr == labels[tune])), len(tune), self.p.confidence)

        ok = [(stats(tune, t)[1], -t if self.p.criterion != "patience" else t, t) for t in cands
              if bound(t) >= target]
        ok.sort()
        for cost, _, t in ok:
            if cost >= n_layers:
                break
            if stats(confirm, t)[0] >= target:
                return t
            self.notes.append(f"threshold {t:g}: top1 met on tune rows, not on confirm rows "
                              f"({stats(confirm, t)[0]:.4f}); trying a stricter one")
        return None

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
                x = pool_features(h, masks, self.p.pool)
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


# ------------------------------------------------------------------ graph building


class _Builder:
    """Nested If construction for one ``call``."""

    def __init__(self, run: _Run, batch_dim, n_layers: int, threshold: float):
        self.run = run
        self.p = run.p
        self.model = run.model
        self.batch_dim = batch_dim
        self.n_layers = n_layers
        self.threshold = threshold
        self.inits: list[ir.Value] = []

    def _const(self, tape: ir.tape.Tape, array: np.ndarray, name: str) -> ir.Value:
        v = tape.initializer(ir.tensor(np.asarray(array), name=name), name=name)
        self.inits.append(v)
        return v

    def _batch_valued(self, v: ir.Value) -> bool:
        return v.shape is not None and len(v.shape) >= 1 and v.shape[0] == self.batch_dim

    def build(self, exits: list[_Exit]) -> str:
        g = self.model.graph
        out = g.outputs[0]
        rowmode = self.p.mode == "row"
        # outer values the tail reads must all be batch-indexed (or constant) in row mode
        if rowmode:
            first = exits[0].value.producer()
            tail = list(g)[list(g).index(first) + 1 :]
            for v in self._reads(tail):
                if not self._batch_valued(v):
                    return (f"mode=row: the layers after {exits[0].layer} read '{v.name}' {v.shape}, which "
                            "has no batch axis; use mode=batch")
            if not self._batch_valued(out):
                return f"mode=row: the output '{out.name}' {out.shape} has no batch axis; use mode=batch"
        outs = [out]
        tape = ir.tape.Tape()
        if self.p.exit_output:
            full = self._exit_layer(tape, out, self.n_layers, "full")
            full.name = self.p.exit_output
            g.extend(tape.nodes)
            g.outputs.append(full)
            outs.append(full)
        names = [v.name for v in outs]
        for v in outs:
            v.name = f"{_PREFIX}/full/{v.name}"
        mask = self.run._mask_input()
        scope_vals: dict[str, ir.Value] = {"mask": mask} if mask is not None else {}
        preds: list[ir.Value] = []
        container, epilogue = g, []
        for i, ex in enumerate(exits):
            if_outs, container, epilogue, scope_vals, preds = self._split(
                container, ex, outs, epilogue, scope_vals, preds, rowmode)
            if i == 0:
                for v, n in zip(if_outs, names):
                    v.name = n
        for v in self.inits:
            g.register_initializer(v)
        common_passes.NameFixPass()(self.model)  # names for the values the tapes left unnamed
        return ""

    def _reads(self, nodes: list[ir.Node]) -> list[ir.Value]:
        inside = {id(v) for n in nodes for v in n.outputs}
        seen, reads = set(), []
        for n in nodes:
            for v in n.inputs:
                if v is None or id(v) in inside or id(v) in seen:
                    continue
                seen.add(id(v))
                if v.is_initializer() or v.const_value is not None:
                    continue
                prod = v.producer()
                if prod is not None and prod.op_type == "Constant":
                    continue
                reads.append(v)
        return reads

    def _exit_layer(self, tape: ir.tape.Tape, like: ir.Value, layer: int, tag: str) -> ir.Value:
        k = self._const(tape, np.array([layer], np.int64), f"{_PREFIX}/exit_layer_{tag}_value")
        start = self._const(tape, np.array([0], np.int64), f"{_PREFIX}/exit_layer_{tag}_start")
        one = self._const(tape, np.array([1], np.int64), f"{_PREFIX}/exit_layer_{tag}_end")
        shape = tape.op("Shape", [like], name=f"{_PREFIX}/exit_layer_{tag}_shape")
        b = tape.op("Slice", [shape, start, one])
        v = tape.op("Expand", [k, b], name=f"{_PREFIX}/exit_layer_{tag}")
        v.name = f"{_PREFIX}/exit_layer_{tag}"
        v.dtype = ir.DataType.INT64
        v.shape = ir.Shape([self.batch_dim])
        return v

    def _head(self, tape: ir.tape.Tape, ex: _Exit, h: ir.Value, mask: ir.Value | None) -> ir.Value:
        pre = f"{_PREFIX}/L{ex.layer}"
        parts = []
        if "cls" in self.p.pool:
            idx = self._const(tape, np.array(0, np.int64), f"{pre}/cls_index")
            parts.append(tape.op("Gather", [h, idx], {"axis": 1}))
        if "mean" in self.p.pool:
            ax1 = self._const(tape, np.array([1], np.int64), f"{pre}/axis1")
            axl = self._const(tape, np.array([-1], np.int64), f"{pre}/axis_last")
            if mask is None:
                parts.append(tape.op("ReduceMean", [h, ax1], {"keepdims": 0}))
            else:
                mf = tape.op("Cast", [mask], {"to": ir.DataType.FLOAT})
                num = tape.op("ReduceSum", [tape.op("Mul", [h, tape.op("Unsqueeze", [mf, axl])]), ax1], {"keepdims": 0})
                one = self._const(tape, np.array(1.0, np.float32), f"{pre}/one")
                den = tape.op("Max", [tape.op("ReduceSum", [mf, ax1], {"keepdims": 1}), one])
                parts.append(tape.op("Div", [num, den]))
        x = parts[0] if len(parts) == 1 else tape.op("Concat", parts, {"axis": 1})
        layers = ex.head.folded()
        for i, (w, b) in enumerate(layers):
            x = tape.op("Gemm", [x, self._const(tape, w, f"{pre}/head_w{i}"), self._const(tape, b, f"{pre}/head_b{i}")])
            if i + 1 < len(layers):
                x = tape.op("Tanh", [x])
        x.name = f"{pre}/logits"
        x.dtype = ir.DataType.FLOAT
        x.shape = ir.Shape([self.batch_dim, layers[-1][0].shape[1]])
        return x

    def _confident(self, tape, ex: _Exit, logits: ir.Value, preds: list[ir.Value]) -> tuple[ir.Value, ir.Value]:
        """(per-row confident [B] bool, argmax [B] int64)."""
        pre = f"{_PREFIX}/L{ex.layer}"
        pred = tape.op("ArgMax", [logits], {"axis": -1, "keepdims": 0})
        pred.name, pred.dtype, pred.shape = f"{pre}/pred", ir.DataType.INT64, ir.Shape([self.batch_dim])
        crit = self.p.criterion
        if crit == "patience":
            t = int(self.threshold)
            history = preds[len(preds) - (t - 1):] if t > 1 else []
            if t < 1 or len(history) < t - 1:
                conf = tape.op("Equal", [pred, tape.op("Add", [pred, self._const(tape, np.array(1, np.int64), f"{pre}/never")])])
            else:
                conf = None
                for q in history:
                    eq = tape.op("Equal", [q, pred])
                    conf = eq if conf is None else tape.op("And", [conf, eq])
                if conf is None:
                    conf = tape.op("Equal", [pred, pred])
        else:
            inv_t = self._const(tape, np.array(1.0 / ex.head.temperature, np.float32), f"{pre}/inv_temperature")
            prob = tape.op("Softmax", [tape.op("Mul", [logits, inv_t])], {"axis": -1})
            axl = self._const(tape, np.array([-1], np.int64), f"{pre}/crit_axis")
            if crit == "maxprob":
                score = tape.op("ReduceMax", [prob, axl], {"keepdims": 0})
            else:
                eps = self._const(tape, np.array(1e-12, np.float32), f"{pre}/eps")
                plogp = tape.op("Mul", [prob, tape.op("Log", [tape.op("Add", [prob, eps])])])
                n_cls = ex.head.layers[-1][0].shape[1]
                coef = self._const(tape, np.array(1.0 / math.log(n_cls), np.float32), f"{pre}/inv_log_classes")
                one = self._const(tape, np.array(1.0, np.float32), f"{pre}/one_e")
                score = tape.op("Add", [one, tape.op("Mul", [tape.op("ReduceSum", [plogp, axl], {"keepdims": 0}), coef])])
            th = self._const(tape, np.array(self.threshold, np.float32), f"{pre}/threshold")
            conf = tape.op("GreaterOrEqual", [score, th])
        conf.name, conf.dtype, conf.shape = f"{pre}/confident", ir.DataType.BOOL, ir.Shape([self.batch_dim])
        return conf, pred

    def _split(self, container: ir.Graph, ex: _Exit, outs: list[ir.Value], epilogue: list[ir.Node],
               scope_vals: dict[str, ir.Value], preds: list[ir.Value], rowmode: bool):
        """Cut ``container`` after ``ex``'s layer: head + criterion + If(then: exit, else: the rest).

        ``outs`` are the values the rest computes (the model's outputs as this scope sees them), read by
        the scope's ``epilogue`` nodes or, at the top, by the graph outputs. Returns the If outputs and,
        for the next exit, the else graph, its epilogue, and this scope's versions of the tracked values.
        """
        pre = f"{_PREFIX}/L{ex.layer}"
        nodes = list(container)
        cut = nodes.index(ex.value.producer())
        ep = {id(n) for n in epilogue}
        tail = [n for n in nodes[cut + 1 :] if id(n) not in ep]
        container.remove(tail)
        container.remove(epilogue)
        tape = ir.tape.Tape()
        logits = self._head(tape, ex, ex.value, scope_vals.get("mask"))
        conf, pred = self._confident(tape, ex, logits, preds)
        preds = preds + [pred]
        all_conf = tape.op("Cast", [tape.op("ReduceMin", [tape.op("Cast", [conf], {"to": ir.DataType.INT32})],
                                             {"keepdims": 0})], {"to": ir.DataType.BOOL})
        all_conf.name = f"{pre}/all_confident"
        # then: this exit's results
        then_tape = ir.tape.Tape()
        then_outs = [then_tape.op("Identity", [logits])]
        then_outs[0].name = f"{pre}/then/logits"
        if len(outs) > 1:
            then_outs.append(then_tape.op("Identity", [self._exit_layer(then_tape, logits, ex.layer, f"L{ex.layer}")]))
            then_outs[-1].name = f"{pre}/then/exit_layer"
        then_g = ir.Graph([], then_outs, nodes=then_tape.nodes, name=f"{pre}_exit")
        # else: the rest of the layers (row mode: on the unconfident rows only, scattered back in order)
        et = ir.tape.Tape()
        new_scope, new_preds = scope_vals, preds
        if rowmode:
            keep = et.op("Not", [conf])
            keep.name = f"{pre}/keep"
            idx = et.op("Transpose", [et.op("NonZero", [keep])], {"perm": [1, 0]})
            idx.name = f"{pre}/keep_index"
            compressed: dict[int, ir.Value] = {}

            def squeeze(v: ir.Value) -> ir.Value:
                if id(v) not in compressed:
                    c = et.op("Compress", [v, keep], {"axis": 0})
                    c.name = f"{pre}/rows/{v.name.split('/')[-1]}"
                    c.dtype, c.shape = v.dtype, v.shape
                    compressed[id(v)] = c
                return compressed[id(v)]

            inside = {id(n) for n in tail}
            for v in self._reads(tail):
                c = squeeze(v)
                for user, j in list(v.uses()):
                    if id(user) in inside:
                        user.replace_input_with(j, c)
            new_scope = {k: squeeze(v) for k, v in scope_vals.items()}
            new_preds = [squeeze(v) for v in preds]
            pt = ir.tape.Tape()
            bases = [logits] + ([self._exit_layer(pt, logits, ex.layer, f"L{ex.layer}_base")] if len(outs) > 1 else [])
            new_epilogue_outs = []
            for base, v in zip(bases, outs):
                s = pt.op("ScatterND", [base, idx, v])
                s.name = f"{pre}/else/{v.name.split('/')[-1]}"
                s.dtype = v.dtype
                s.shape = ir.Shape([self.batch_dim] + list(v.shape[1:])) if v.shape is not None else None
                new_epilogue_outs.append(s)
            new_epilogue = list(pt.nodes)
        else:
            new_epilogue_outs = []
            for v in outs:
                o = et.op("Identity", [v])
                o.name = f"{pre}/else/{v.name.split('/')[-1]}"
                o.dtype, o.shape = v.dtype, v.shape
                new_epilogue_outs.append(o)
            new_epilogue = list(et.nodes)
            et = ir.tape.Tape()
        else_g = ir.Graph([], new_epilogue_outs, nodes=list(et.nodes) + tail + new_epilogue, name=f"{pre}_deeper")
        if_node = ir.node("If", [all_conf], {"then_branch": then_g, "else_branch": else_g},
                          num_outputs=len(outs), name=f"{pre}/If")
        for o, ref in zip(if_node.outputs, outs):
            o.name = f"{pre}/out/{ref.name.split('/')[-1]}"
            o.dtype = ref.dtype
            o.shape = ir.Shape([self.batch_dim] + list(ref.shape[1:])) if ref.shape is not None else None
        # this scope now reads the If's outputs where it read the rest's
        swap = {id(ref): o for ref, o in zip(outs, if_node.outputs)}
        for n in epilogue:
            for j, v in enumerate(n.inputs):
                if v is not None and id(v) in swap:
                    n.replace_input_with(j, swap[id(v)])
        container.extend(list(tape.nodes) + [if_node] + list(epilogue))
        if container is self.model.graph:
            for j in range(len(container.outputs)):
                if id(container.outputs[j]) in swap:
                    container.outputs[j] = swap[id(container.outputs[j])]
        return list(if_node.outputs), else_g, new_epilogue, new_scope, new_preds


register(EarlyExit)
