"""``speculative-heads``: Medusa-1 draft heads fitted by self-distillation, as an extra output (exact for logits).

The decoder's last hidden state ``h`` (the input of the LM head MatMul that makes ``logits``) feeds K heads
(``heads``, default 3), each a residual block ``h + SiLU(h W_k + b_k)`` followed by the shared LM head; head k
at position t guesses the token at t + k + 2. The graph gains the output ``medusa_logits`` [batch, sequence, K,
vocab] and the metadata ``graphopt.speculative = medusa:K``; ``logits`` and the present cache are computed by
the same nodes as before (bit-identical). ``graphopt generate --speculative heads`` (or ``auto``) drafts with
them (``graphopt.generate.medusa``)::

    h ── MatMul(W_lm) ──▶ logits
     └── K residual SiLU blocks ── MatMul(W_lm) ──▶ medusa_logits        (graph.py)

Fitting (``fit.py``): calibration prompts (windows of ``text``, default the decoder-budget calibration text
``graphopt.data.heldout``, tokenized with ``tokenizer``, a folder with ``tokenizer.json``; without a tokenizer,
seeded random token prompts) are continued greedily by the model, the sequences run teacher-forced, and the
heads fitted in torch to the model's own choices. Acceptance is then measured on held-out prompts
(``graphopt/bench/data/heldout.txt``, never calibrated on; random prompts of another seed without a tokenizer)
and the forward of the graph with heads timed by width against a plain one-token forward; the pass declines
(graph unchanged, the table in its notes) unless the best draft length makes at least ``min_gain`` times the
tokens per second of plain decoding. Refuses when ``logits`` is not made by a float32 ``MatMul`` with a constant
weight (a quantized LM head), or the graph is not a decoder with past. Not in any default recipe.
"""

from __future__ import annotations

import json

import onnx_ir as ir

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import UsageError
from graphopt.generate.loop import Decoder
from graphopt.generate.medusa import METADATA_KEY
from graphopt.rewrites.common.calibration_prompts import prompt_sets
from graphopt.rewrites.speculative_heads import fit
from graphopt.rewrites.speculative_heads.graph import OUTPUT, add_heads, find_lm_head
from graphopt.runtime.session import make_session


class SpeculativeHeadsPass(GraphoptPass):
    """Add Medusa-1 draft heads (fitted to the model's own greedy text) as a medusa_logits output."""

    name = "speculative-heads"
    exact = True
    in_default_recipe = False
    run_after = ("group-query-attention",)

    def __init__(self, *, heads: int = 3, tokenizer: str = "", text: str = "", heldout: str = "",
                 prompts: int = 32, prompt_tokens: int = 16, new_tokens: int = 48, epochs: int = 8,
                 lr: float = 1e-3, batch: int = 256, fit_seconds: float = 240.0, min_gain: float = 1.05,
                 threads: int = 2, seed: int = 0):
        super().__init__()
        if not 1 <= heads <= 8:
            raise UsageError(f"speculative-heads: heads must be 1..8 (got {heads})")
        if prompts < 1 or prompt_tokens < 1 or new_tokens < heads + 1:
            raise UsageError("speculative-heads: prompts and prompt_tokens must be >= 1, new_tokens > heads")
        self.heads, self.tokenizer, self.text, self.heldout = heads, tokenizer, text, heldout
        self.prompts, self.prompt_tokens, self.new_tokens = prompts, prompt_tokens, new_tokens
        self.epochs, self.lr, self.batch, self.fit_seconds = epochs, lr, batch, fit_seconds
        self.min_gain, self.threads, self.seed = min_gain, threads, seed

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        found = find_lm_head(model)
        if isinstance(found, str):
            return PassResult(model, False, notes=[f"speculative-heads: not applied: {found}"])
        head, h, lm = found
        k = self.heads
        graph = model.graph
        graph.outputs.append(h)  # the hidden state, for collection only
        try:
            dec = Decoder(make_session(model, threads=self.threads))
            calib, held, source = prompt_sets(self.name, tokenizer=self.tokenizer, text=self.text,
                                              heldout=self.heldout, vocab=lm.shape[1], length=self.prompt_tokens,
                                              count=self.prompts, seed=self.seed)
            train = fit.collect(dec, h.name, calib, self.new_tokens, k)
            test = fit.collect(dec, h.name, held, self.new_tokens, k)
        finally:
            graph.outputs.pop()
        w, b = fit.fit_heads(train, lm, epochs=self.epochs, lr=self.lr, batch=self.batch, seed=self.seed,
                             seconds=self.fit_seconds)
        chain = fit.chain_table(test, fit.head_choices(test, lm, w, b))
        out = add_heads(model, head, h, w, b)
        heads_dec = Decoder(make_session(model, threads=self.threads))
        heads_dec.extra_outputs = (OUTPUT,)
        ratio = fit.forward_ratios(dec, heads_dec, k + 1, past=64, repeats=5)
        drafts, gain = fit.best_gain(chain, ratio)
        table = (f"speculative-heads: {k} heads fitted on {len(train.hidden)} positions ({len(calib)} prompts, "
                 f"{source}); held-out acceptance P(first j drafts kept) = "
                 + ", ".join(f"{j + 1}: {p:.3f}" for j, p in enumerate(chain))
                 + "; forward cost with heads by width over plain width 1 = "
                 + ", ".join(f"{j + 1}: {r:.2f}x" for j, r in enumerate(ratio))
                 + f"; best: {drafts} drafts, {gain:.2f}x tokens/s")
        if gain < self.min_gain:
            graph.outputs.remove(out)
            for node in reversed([n for n in graph if n.name.startswith("medusa/")]):
                graph.remove(node, safe=True)
            for name in [n for n in graph.initializers if n.startswith("medusa.")]:
                graph.initializers.pop(name)
            return PassResult(model, False, notes=[table, f"speculative-heads: declined (best {gain:.2f}x < "
                                                          f"min_gain {self.min_gain})"])
        model.metadata_props[METADATA_KEY] = f"medusa:{k}"
        model.metadata_props["graphopt.medusa_acceptance"] = json.dumps([round(p, 4) for p in chain])
        return PassResult(model, True, notes=[table], rule_counts={"medusa-heads": k})


register(SpeculativeHeadsPass)
