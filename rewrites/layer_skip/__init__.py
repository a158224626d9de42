"""``layer-skip-draft``: a self-speculative draft from the decoder's first L layers and a fitted exit head.

For each candidate L (``layers``, default about N/6, N/4, N/3, N/2, 2N/3 and 5N/6 of N layers) the residual stream
entering layer L is found (``graph.py``), an exit head fitted by least squares from it to the final normed
hidden state on the model's own greedy continuations of calibration text (``fit.py``), and the draft graph
(``graphopt.generate.layer_skip.draft_graph``: the first L layers, the exit head, the model's LM head) measured:
held-out acceptance per draft length, and its one-token forward against the model's, interleaved with the
model's verifying forwards per width. The best (L, drafts) by expected tokens/s is kept when it reaches
``min_gain`` (``min_gain=0``: the best L is kept whatever it measures, with at least one draft): the graph gains the exit head as initializers (``layer_skip.map``, ``layer_skip.bias``; no node
reads them, so ORT's session of the model drops them) and the metadata ``graphopt.speculative = layer-skip``,
``graphopt.layer_skip`` (L, the hidden state's name, drafts, acceptance). Nodes and outputs are unchanged
(exact). ``graphopt generate --speculative layer-skip`` (or ``auto``) cuts the draft out at load time::

    input ── layers 0 .. L-1 ── h_L ── layers L .. N-1 ── norm ── LM head ──▶ logits          (the model)
                                 └── rms ── map ── LM head ──▶ draft logits                  (the draft)

Declines (graph unchanged, the measured table in its notes) when no L pays. Refuses a graph that is not a
decoder with past or whose LM head does not read a [batch, sequence, hidden] value. Not in any default recipe.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from graphopt.analysis import lm_head
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate import layer_skip
from graphopt.generate.loop import Decoder
from graphopt.rewrites.common.calibration_prompts import prompt_sets
from graphopt.rewrites.layer_skip import fit
from graphopt.rewrites.layer_skip.graph import find_hidden, hidden_width, layer_count
from graphopt.runtime.session import make_session


class LayerSkipDraftPass(GraphoptPass):
    """Add a layer-skip draft (first L layers + least-squares exit head) when one pays on calibration text."""

    name = "layer-skip-draft"
    exact = True
    in_default_recipe = False
    run_after = ("group-query-attention",)

    def __init__(self, *, layers: str = "", drafts: int = 6, tokenizer: str = "", text: str = "",
                 heldout: str = "", prompts: int = 16, prompt_tokens: int = 16, new_tokens: int = 48,
                 ridge: float = 0.1, min_gain: float = 1.05, threads: int = 2, repeats: int = 5, seed: int = 0):
        super().__init__()
        try:
            self.layers = [int(x) for x in str(layers).replace(";", ",").split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"layer-skip-draft: layers must be a comma list of layer counts (got {layers!r})") from None
        if not 1 <= drafts <= 16 or prompts < 1 or prompt_tokens < 1 or new_tokens < drafts + 1:
            raise UsageError("layer-skip-draft: drafts must be 1..16, prompts and prompt_tokens >= 1, "
                             "new_tokens > drafts")
        self.drafts, self.tokenizer, self.text, self.heldout = drafts, tokenizer, text, heldout
        self.prompts, self.prompt_tokens, self.new_tokens = prompts, prompt_tokens, new_tokens
        self.ridge, self.min_gain, self.threads, self.repeats, self.seed = ridge, min_gain, threads, repeats, seed

    def _candidates(self, n: int) -> list[int]:
        picks = self.layers or sorted({max(1, round(n * f)) for f in (1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 5 / 6)})
        return [L for L in picks if 1 <= L < n]

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        graph = model.graph
        skip = lambda why: PassResult(model, False, notes=[f"layer-skip-draft: not applied: {why}"])  # noqa: E731
        n = layer_count(graph)
        width = hidden_width(graph) if "logits" in {o.name for o in graph.outputs} else "the graph has no 'logits'"
        if n < 2 or isinstance(width, str):
            return skip(width if isinstance(width, str) else f"{n} layer(s): nothing to skip")
        found = {L: find_hidden(graph, L, width) for L in self._candidates(n)}
        hidden = {L: v for L, v in found.items() if not isinstance(v, str)}
        if not hidden:
            return skip("; ".join(f"L={L}: {v}" for L, v in found.items()))
        final = lm_head.head_input(graph)  # a value: hidden_width found it
        extra = list(dict.fromkeys([*hidden.values(), final]))
        added = [v for v in extra if v not in graph.outputs]
        graph.outputs.extend(added)  # for collection only
        try:
            dec = Decoder(make_session(model, threads=self.threads))
            calib, held, source = prompt_sets(self.name, tokenizer=self.tokenizer, text=self.text,
                                              heldout=self.heldout, vocab=dec.sig.vocab or 2, seed=self.seed,
                                              length=self.prompt_tokens, count=self.prompts)
            names = [v.name for v in extra]
            train = fit.collect(dec, names, calib, self.new_tokens)
            test = fit.collect(dec, [], held, self.new_tokens)
        finally:
            for v in added:
                graph.outputs.remove(v)
        y = np.concatenate(train.hidden[final.name])
        proto = ir.to_proto(model)
        rows, drafters = [], []
        for L, h in hidden.items():
            a, c = fit.fit_map(np.concatenate(train.hidden[h.name]), y, self.ridge)
            sub = layer_skip.draft_graph(ir.from_proto(proto), L, h.name, a, c)
            draft = Decoder(make_session(sub, threads=self.threads), name=f"layer-skip draft L={L}")
            rows.append({"layers": L, "hidden": h.name, "chain": fit.chain_table(draft, test, self.drafts),
                         "map": a, "bias": c})
            drafters.append(draft)
        dec = Decoder(make_session(model, threads=self.threads))
        timed = fit.forward_seconds([(dec, range(1, self.drafts + 2)), *[(d, [1]) for d in drafters]],
                                    past=64, repeats=self.repeats)
        one = timed[0][1]
        ratio = [1.0] + [timed[0][w] / one for w in range(1, self.drafts + 2)]  # ratio[k]: width k, index 0 unused
        for row, t in zip(rows, timed[1:]):
            row["cost"] = t[1] / one
            row["drafts"], row["gain"] = fit.best_drafts(row["chain"], ratio[1:], row["cost"])
        table = [f"layer-skip-draft: {n} layers, exit heads fitted on {len(y)} positions ({len(calib)} prompts, "
                 f"{source}); verifying forward by width over width 1: "
                 + ", ".join(f"{w}: {ratio[w]:.2f}x" for w in range(2, self.drafts + 2))]
        for r in rows:
            table.append(f"layer-skip-draft: L={r['layers']}: draft forward {r['cost']:.2f}x a model forward; "
                         "held-out P(first j kept) " + ", ".join(f"{p:.3f}" for p in r["chain"])
                         + f"; best {r['drafts']} drafts: {r['gain']:.2f}x tokens/s")
        best = max(rows, key=lambda r: r["gain"])
        if self.min_gain <= 0:  # keep the best L whatever it measures (tests, experiments)
            best["drafts"] = best["drafts"] or 1
        if best["gain"] < self.min_gain or best["drafts"] == 0:
            return PassResult(model, False, notes=[*table, f"layer-skip-draft: declined (best {best['gain']:.2f}x "
                                                            f"< min_gain {self.min_gain})"])
        for name, arr in ((layer_skip.MAP, best["map"]), (layer_skip.BIAS, best["bias"])):
            if name in graph.initializers:
                graph.initializers.pop(name)
            v = ir.Value(name=name, const_value=ir.tensor(arr, name=name))
            v.shape, v.type = ir.Shape(arr.shape), ir.TensorType(ir.DataType.FLOAT)
            graph.register_initializer(v)
        model.metadata_props[layer_skip.SPECULATIVE_KEY] = layer_skip.TAG
        model.metadata_props[layer_skip.LAYER_SKIP_KEY] = json.dumps(
            {"layers": best["layers"], "hidden": best["hidden"], "drafts": best["drafts"],
             "acceptance": round(best["chain"][0], 4), "chain": [round(p, 4) for p in best["chain"]],
             "gain": round(best["gain"], 3)})
        return PassResult(model, True, notes=[*table, f"layer-skip-draft: L={best['layers']}, {best['drafts']} "
                                                      f"drafts, expected {best['gain']:.2f}x"],
                          rule_counts={"layer-skip-draft": 1})


register(LayerSkipDraftPass)
