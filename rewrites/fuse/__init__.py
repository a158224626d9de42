"""Fuse transformer subgraphs into ONNX Runtime contrib ops, whichever exporter made the graph.

Pass ``fuse``: lossless. It prepares the graph (constant folding, shape inference, symbolic shapes,
see ``fuse_shapes``) and then applies rule families in order; each rule matches a subgraph, checks
it (every refusal has a reason, shown by ``--explain fuse``) and rewrites it with the builder::

    ReduceMean/Sub/Pow/ReduceMean/Add/Sqrt/Div/Mul/Add ──▶ LayerNormalization (see fuse_layernorm)
    LayerNormalization(Add(x, skip [+ bias]))          ──▶ SkipLayerNormalization
                                                       ──▶ on CPU: Sum(x, skip[, bias]) + LayerNormalization
                                                           (ORT's CPU SkipLayerNormalization kernel is 4x
                                                           slower; see fuse_residual_norm; option skip_norm)
    x*0.5*(1+Erf(x/sqrt2))  /  tanh form               ──▶ Gelu / FastGelu (tanh: see fuse_gelu_tanh)
    Gelu(Add(MatMul(x, W), b))                         ──▶ BiasGelu(MatMul(x, W), b)
    Reshape/Transpose(q,k,v) ─ MatMul ─ scale ─ (+mask) ─ Softmax ─ [IsNaN/Where] ─ MatMul ─ Transpose/Reshape
                                                       ──▶ MultiHeadAttention ──▶ Attention (packed QKV)
    Attention(bias = f(attention_mask [B, S]))         ──▶ Attention(mask_index = Cast(attention_mask, int32))
                                                           when f is proven the standard padding bias
                                                           (see fuse_mask_index; the mask nodes become dead)
    LayerNormalization(Gather(word, ids) + Gather(type, tt) + Gather(pos, 0..S-1))
                                                       ──▶ EmbedLayerNormalization (see fuse_embed_layernorm)
    rotary with positions start + 0..S-1               ──▶ RotaryEmbedding with a run-time cos/sin cache
                                                           (see fuse_rotary_cache)
    RMSNorm / SkipRMSNorm / RotaryEmbedding / GQA      ──▶ RMSNormalization (opset >= 23; see fuse_rms_norm),
                                                           SkipSimplifiedLayerNormalization, RotaryEmbedding
                                                           (partial: fuse_rotary_partial), GroupQueryAttention

The attention, layer-norm, GELU, rotary and GQA rules are onnxscript's ``ort_fusions`` (used as a
dependency); graphopt adds the shape preparation that lets them see TorchScript exports and the
embedding fusion. Nothing is fused where an intermediate value is used outside the matched subgraph
(the rewriter refuses such matches), and where no pattern matches the graph is left as it was.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common_passes
from onnxscript.optimizer import optimize
from onnxscript.rewriter import MatchingTracer, MatchStatus, pattern
from onnxscript.rewriter.ort_fusions import (
    attention,
    bias_gelu,
    cos_sin_cache,
    erfgelu,
    gelu,
    gqa_packed_qkv,
    mha_bias,
    rms_normalization,
    rotary_embedding,
    sdpa,
    shape_optimization,
    skip_normalization,
)

from graphopt.analysis.fusion_status import fusion_status
from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.errors import PassError, UsageError
from graphopt.onnxscript_compat import exact_identity_constants, mha_scale_rules, sdpa_via_mha_rules
from graphopt.opsets import FUSION_PLACEHOLDER_DOMAIN, MS_DOMAIN, default_opset
from graphopt.rewrites.fuse.rules import mha as fuse_mha
from graphopt.rewrites.fuse.rules.canonical import canonical_rules, shape_rules
from graphopt.rewrites.fuse.rules.embed_layernorm import embed_layer_norm_rules
from graphopt.rewrites.fuse.rules.gelu_tanh import tanh_gelu_rules
from graphopt.rewrites.fuse.rules.gqa import gqa_rules
from graphopt.rewrites.fuse.rules.layernorm import layer_norm_rules, layer_norm_scale_rules
from graphopt.rewrites.fuse.rules.mask_index import MaskIndexStep
from graphopt.rewrites.fuse.rules.residual_norm import ResidualNormStep
from graphopt.rewrites.fuse.rules.rms_norm import RmsNormStep
from graphopt.rewrites.fuse.rules.rotary_cache import rotary_cache_rules
from graphopt.rewrites.fuse.rules.rotary_partial import partial_rotary_rules
from graphopt.rewrites.fuse.rules.shapes import annotate_symbolic_shapes

logger = logging.getLogger(__name__)

#: the fusion rules emit current-opset forms; older graphs are left alone
MIN_OPSET = 13

#: op types whose count tells what was fused (for the report and --explain)
FUSED_OPS = (
    "Attention",
    "MultiHeadAttention",
    "GroupQueryAttention",
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "RMSNormalization",
    "EmbedLayerNormalization",
    "BiasGelu",
    "FastGelu",
    "Gelu",
    "RotaryEmbedding",
)


def _prepare(model: ir.Model) -> str | None:
    """Fold constants, infer shapes, simplify shape arithmetic; annotate symbolic shapes."""

    try:
        common_passes.ShapeInferencePass()(model)
    except ir.serde.SerdeError as e:  # e.g. a ZipMap's sequence-of-map output: onnx-ir has no map type
        logger.info("fuse: ONNX shape inference result unreadable (%s); shapes left as they are", e)
    optimize(model, inline=False)  # graphopt's own ai.graphopt functions stay functions
    shape_optimization.rules.apply_to_model(model)
    optimize(model, inline=False)
    return annotate_symbolic_shapes(model)


def _steps(opts: FusePass, provider: str) -> list[tuple[str, Any]]:
    """(rule family, onnxscript RewriteRuleSet or callable) in the order they must run."""
    def cse(model):
        common_passes.CommonSubexpressionEliminationPass()(model)
        return 0


    steps: list[tuple[str, Any]] = [("canonical", canonical_rules), ("identity_reshape", _ThenDropIdentities(shape_rules))]
    if opts.embed_layer_norm:
        steps.append(("embed_layer_normalization", embed_layer_norm_rules))
    if opts.gelu != "off":
        steps.append(("erf_gelu", erfgelu.rules))
    if opts.layer_norm:
        steps += [
            ("layer_normalization", layer_norm_rules),
            ("layer_normalization_no_bias", layer_norm_scale_rules),
            ("rms_normalization", rms_normalization.rms_normalization_ruleset),
            ("skip_layer_normalization", skip_normalization.skip_layer_normalization_ruleset),
            ("skip_rms_normalization", skip_normalization.skip_rms_normalization_ruleset),
        ]
    if opts.rotary:
        steps += [
            ("rotary_embedding", rotary_embedding.rotary_embedding_rules),
            ("cos_sin_cache", cos_sin_cache.cos_sin_cache_rules),
            ("rotary_from_positions", rotary_cache_rules),
            ("cse", cse),
            ("partial_rotary_embedding", partial_rotary_rules),
        ]
    if opts.attention:
        steps += [
            ("sdpa", _ThenInferShapes(sdpa.sdpa_rules)),
        ]
        if opts.gqa:
            # onnxscript's GQA rule derives per-row lengths from the position ids and drops the
            # attention mask: exact only when every row is right-padded (or unpadded); opt-in
            steps += [("gqa", gqa_rules), ("packed_qkv_for_gqa", gqa_packed_qkv.fuse_qkv_gqa_rules)]
        steps += [
            ("mha1", fuse_mha.mha_rules_with_past),
            ("mha2", fuse_mha.mha_rules_no_past),
            ("mha_scale", mha_scale_rules),
            ("mha_bias", mha_bias.mha_bias_rules),
            ("attention", attention.attention_rules),
        ]
        if opts.mask_index:
            steps.append(("mask_index", MaskIndexStep()))
    if opts.gelu != "off":
        steps.append(("tanh_gelu", tanh_gelu_rules))
        steps.append(("gelu", gelu.gelu_rules))
        steps.append(("bias_gelu", bias_gelu.bias_gelu_rules))
    if opts.attention:
        # an SDPA left without a MultiHeadAttention form is expanded into MultiHeadAttention + reshapes
        steps.append(("sdpa_via_mha", sdpa_via_mha_rules))
    if opts.layer_norm and _sum_form(opts, provider):
        steps.append(("residual_norm", ResidualNormStep()))
    if opts.layer_norm:
        # ORT's SimplifiedLayerNormalization is no ONNX op: RMSNormalization (opset >= 23) or standard ops
        steps.append(("rms_normalization_onnx", RmsNormStep()))
    for _name, step in steps:  # an operand is dropped only when it is the identity exactly
        rules = getattr(step, "rules", step)
        if isinstance(rules, pattern.RewriteRuleSet):
            exact_identity_constants(rules)
    return steps


def _sum_form(opts: FusePass, provider: str) -> bool:
    """Whether residual LayerNorms end as Sum + LayerNormalization (CPU) or SkipLayerNormalization."""
    if opts.skip_norm == "auto":
        return provider != "cuda"
    return opts.skip_norm == "sum"


class _ThenInferShapes:
    """A rule set whose rewrites add nodes that later rules need shapes on."""

    def __init__(self, rules):
        self.rules = rules

    def apply_to_model(self, model: ir.Model, **kwargs) -> int:
        n = self.rules.apply_to_model(model, **kwargs)
        if n:
            common_passes.ShapeInferencePass()(model)
        return n


class _ThenDropIdentities(_ThenInferShapes):
    """A rule set that rewrites to ``Identity``; the identities are then removed."""

    def apply_to_model(self, model: ir.Model, **kwargs) -> int:
        n = self.rules.apply_to_model(model, **kwargs)
        if n:
            common_passes.IdentityEliminationPass()(model)
        return n


def _apply(step: Any, model: ir.Model) -> int:
    if callable(step):
        return step(model)
    return step.apply_to_model(model)


def _why_not(step: Any, model: ir.Model, rule_name: str) -> str | None:
    """The best partial match of a rule family and why it failed, as one line (or None)."""
    if hasattr(step, "why_not"):
        return step.why_not(model)
    if callable(step):
        return None

    tracer = MatchingTracer()
    step.apply_to_model(model, tracer=tracer)
    best = None
    for rule, matches in tracer.best_matches_map.items():
        for m in matches:
            if m.status == MatchStatus.SUCCESS:
                continue
            if best is None or m.score() > best[1].score():
                best = (rule, m)
    if best is None:
        return None
    rule, m = best
    reason = m.match_result.reason or m.status.name
    return f"fuse: {rule_name} ({rule.name or type(rule).__name__}) at {m.root_node.op_type} {m.root_node.name!r}: {reason}"


class FusePass(GraphoptPass):
    """Fuse attention, LayerNorm, GELU and embeddings into ONNX Runtime contrib ops (any exporter)."""

    name = "fuse"
    exact = True
    emits = tuple(f"{MS_DOMAIN}::{op}" for op in FUSED_OPS if op != "RMSNormalization")
    run_after = ("cleanup",)

    def __init__(
        self,
        *,
        attention: bool = True,
        layer_norm: bool = True,
        gelu: str = "auto",
        embed_layer_norm: bool = True,
        rotary: bool = True,
        mask_index: bool = True,
        gqa: bool = False,
        skip_norm: str = "auto",
    ):
        super().__init__()

        if gelu not in ("auto", "off"):
            raise UsageError(f"fuse.gelu must be 'auto' or 'off', got {gelu!r}")
        if skip_norm not in ("auto", "fused", "sum"):
            raise UsageError(f"fuse.skip_norm must be 'auto', 'fused' or 'sum', got {skip_norm!r}",
                             hint="auto: Sum + LayerNormalization for cpu, SkipLayerNormalization for cuda")
        self.attention = attention
        self.layer_norm = layer_norm
        self.gelu = gelu
        self.embed_layer_norm = embed_layer_norm
        self.rotary = rotary
        self.mask_index = mask_index
        self.gqa = gqa
        self.skip_norm = skip_norm

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        original = model.clone() if self.attention else None  # tensors are shared: a cheap copy
        result = _fuse(model, ctx, self)
        left = _placeholders(model)
        if left and original is not None:
            # an attention rule matched but no later rule mapped its placeholder (onnxscript's SDPA) to a contrib
            # op: the placeholder is no op ORT knows, so attention stays as the exporter wrote it
            retry = _fuse(original, ctx, types.SimpleNamespace(**{**vars(self), "attention": False}))
            model.graph = original.graph
            model.functions.clear()
            model.functions.update(original.functions)
            note = (f"fuse: attention left unfused: {len(left)} {left[0].op_type} placeholder(s) had no "
                    f"contrib-op form (first {left[0].name!r})")
            result = PassResult(model, retry.modified, notes=[note, *retry.notes], rule_counts=retry.rule_counts)
            left = _placeholders(model)
        if left:
            raise PassError(f"fuse: {len(left)} placeholder op(s) of {FUSION_PLACEHOLDER_DOMAIN} left in the graph "
                            f"({left[0].op_type} {left[0].name!r})")
        return result


def _placeholders(model: ir.Model) -> list[ir.Node]:
    """Nodes left in onnxscript's placeholder domain that no model function defines (ORT cannot run them)."""
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
            if n.domain == FUSION_PLACEHOLDER_DOMAIN and (n.domain, n.op_type, n.overload) not in model.functions]


def _fuse(model: ir.Model, ctx: PassContext, opts) -> PassResult:
    """Run the fusion steps for the options on ``opts`` (a FusePass or the same fields) on ``model`` in place."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        return PassResult(model, False, notes=[f"fuse: opset {opset} < {MIN_OPSET}; graph left as it is"])
    notes: list[str] = []
    reason = _prepare(model)
    if reason:
        logger.info("fuse: %s; TorchScript-style attention may stay unfused", reason)
        if ctx.explain:
            notes.append(f"fuse: shapes: {reason}")
    counts: dict[str, int] = {}
    steps = _steps(opts, ctx.provider)
    misses: list[str] = []
    for rule_name, step in steps:
        n = _apply(step, model)
        if n:
            counts[rule_name] = n
        elif ctx.explain:
            # traced right away: the graph is the one the rule just failed on, so nothing matches
            why = _why_not(step, model, rule_name)
            if why:
                misses.append(why)
    if not counts:
        # nothing fused: report unmodified so the pipeline keeps the graph exactly as it was
        # (the preparation above folded constants and inferred shapes on this working copy)
        if ctx.explain:
            notes.extend(_explain(model, misses))
        return PassResult(model, False, notes=notes)
    optimize(model, inline=False)
    folded = _fold_weight_concats(model)
    if folded:
        counts["fold_weight_concat"] = folded
    common_passes.RemoveUnusedNodesPass()(model)
    if ctx.explain:
        notes.extend(_explain(model, misses))
        if not opts.gqa and any(n.op_type == "MultiHeadAttention" for n in model.graph):
            notes.append(
                "fuse: gqa: GroupQueryAttention not tried (option gqa=false): it replaces the attention "
                "mask by per-row lengths, exact only for right-padded batches; MultiHeadAttention used (the "
                "group-query-attention pass, in the decoder recipe, rewrites it for causal LMs with past)"
            )
    return PassResult(model, True, notes=notes, rule_counts=counts)


def _fold_weight_concats(model: ir.Model) -> int:
    """``Concat`` of constant weights (the packed QKV of Attention) becomes one initializer.

    onnxscript's folder leaves concats above its size limit; ORT would fold them at every session
    start. Refuses (leaves the node) when an input is not a constant or is used elsewhere (folding
    would store the weight twice).
    """
    done = 0
    for node in list(model.graph):
        if node.op_type != "Concat" or node.domain != "" or not node.inputs:
            continue
        if any(v is None or v.const_value is None or len(v.uses()) != 1 for v in node.inputs):
            continue
        axis = node.attributes.get_int("axis", 0)
        arr = np.concatenate([v.const_value.numpy() for v in node.inputs], axis=axis)
        out = node.outputs[0]
        value = ir.Value(name=f"{out.name}_folded", shape=ir.Shape(arr.shape), type=out.type,
                         const_value=ir.tensor(arr, name=f"{out.name}_folded"))
        model.graph.register_initializer(value)
        out.replace_all_uses_with(value)
        done += 1
    return done


def _explain(model: ir.Model, misses: list[str]) -> list[str]:
    """Why expected sites stayed unfused: the fusion status plus each idle rule's best near-miss."""
    status = fusion_status(model)
    notes = []
    after_add = status.get("layer_norm_after_add", 0)
    if not status["fully_fused"] or after_add:
        notes.extend(misses)
    for kind in ("attention", "layer_norm", "gelu", "rotary"):
        s = status[kind]
        if s["unfused"]:
            notes.append(f"fuse: {s['unfused']} {kind} site(s) left unfused: {', '.join(s['unfused_nodes'][:5])}")
    if after_add:
        notes.append(f"fuse: {after_add} LayerNormalization after an Add (SkipLayerNormalization or "
                     "EmbedLayerNormalization where the pattern allows)")
    if not notes:
        notes.append("fuse: every attention, LayerNorm, GELU and rotary site is fused")
    return notes


register(FusePass)
