"""``cleanup``: lossless graph cleanup.

Constant folding (onnxscript's optimizer, with ONNX node-level shape inference), shape-computation
simplification and no-op removal (onnxscript's default rewrite rules: Reshape/Expand/Slice/Cast
no-ops, Shape∘Concat chains), identity elimination, dead-code and unused-function/opset removal,
common-subexpression elimination, constant lifting and initializer deduplication (onnx-ir passes).

Refuses to touch (by construction of the underlying passes):
- initializers that are also graph inputs: the caller may override them, so they are never folded,
  deduplicated or lifted;
- old opsets: shape rewrite rules run only from opset 18 (they emit current forms); IR < 4 models keep
  every initializer a graph input, as that IR requires;
- ops of unknown domains: they are kept as they are (only dead ones are removed);
- functions of the ``ai.graphopt`` domain: never inlined (``inline=True`` inlines the others).
Subgraphs (If/Loop/Scan bodies) are cleaned recursively.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import RewritePass

from graphopt.engine.registry import GraphoptPass, PassContext, PassResult, register
from graphopt.engine.verify import check_structure
from graphopt.errors import VerificationError
from graphopt.onnxscript_compat import (
    DEFAULT_REWRITE_RULES,
    FOLD_INPUT_SIZE_LIMIT,
    FOLD_OUTPUT_SIZE_LIMIT,
    FoldConstantsPass,
)
from graphopt.opsets import default_opset

CUSTOM_DOMAIN = "ai.graphopt"
#: onnxscript's rewrite rules are written for opset 18+; below it only folding and DCE run
MIN_RULES_OPSET = 18


class _InlineForeignFunctions(ir.passes.InPlacePass):
    """Inline model-local functions except graphopt's own custom ops."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        keep = {k: f for k, f in model.functions.items() if f.domain == CUSTOM_DOMAIN}
        if len(keep) == len(model.functions):
            return ir.passes.PassResult(model, False)
        for k in keep:
            del model.functions[k]
        result = common.InlinePass()(model)
        model.functions.update(keep)
        return ir.passes.PassResult(model, result.modified)


class _SafeIdentityElimination(ir.passes.InPlacePass):
    """Remove Identity nodes whose output is not a graph output (main graph and subgraphs).

    onnx-ir's IdentityEliminationPass also rewires graph outputs to graph inputs, which turns a
    Loop/Scan body output into its own input; ONNX Runtime then reads garbage (seen with a Loop
    body ``cond_out = Identity(cond_in)``). Identities that feed a graph output are kept.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
                continue
            src, out = node.inputs[0], node.outputs[0]
            if src is None or out.is_graph_output():
                continue
            out.replace_all_uses_with(src)
            node.graph.remove(node, safe=True)
            modified = True
        return ir.passes.PassResult(model, modified)


class CleanupPass(GraphoptPass):
    """Lossless cleanup: constant folding, shape simplification, DCE, identity removal, CSE, dedup."""

    name = "cleanup"
    exact = True

    def __init__(
        self,
        *,
        fold_constants: bool = True,
        rewrite_rules: bool = True,
        cse: bool = True,
        inline: bool = False,
        fold_input_size_limit: int = FOLD_INPUT_SIZE_LIMIT,
        fold_output_size_limit: int = FOLD_OUTPUT_SIZE_LIMIT,
        iterations: int = 2,
    ):
        super().__init__()
        self.fold_constants = fold_constants
        self.rewrite_rules = rewrite_rules
        self.cse = cse
        self.inline = inline
        self.fold_input_size_limit = fold_input_size_limit
        self.fold_output_size_limit = fold_output_size_limit
        self.iterations = iterations

    def call(self, model: ir.Model, ctx: PassContext) -> PassResult:
        opset = default_opset(model)
        if opset >= MIN_RULES_OPSET or not self.fold_constants:
            return PassResult(model, self._run(model, self.fold_constants))
        # Below opset 18 onnxscript's folder can emit current-opset forms (e.g. Unsqueeze with an
        # axes input at opset 11): try on a copy, keep it only if it is still a valid model.
        # (The trial runs twice on success; models this old are small.)
        trial = model.clone()
        self._run(trial, True)
        try:
            check_structure(trial, where="cleanup trial")
        except VerificationError as e:
            return PassResult(model, self._run(model, False),
                              notes=[f"constant folding skipped at opset {opset}: {e.message}"])
        return PassResult(model, self._run(model, True))

    def _run(self, model: ir.Model, fold: bool) -> bool:
        """Run the cleanup passes on ``model`` in place; whether anything changed."""
        loop: list[ir.passes.PassBase] = []
        if fold:
            loop.append(
                FoldConstantsPass(
                    shape_inference=True,
                    input_size_limit=self.fold_input_size_limit,
                    output_size_limit=self.fold_output_size_limit,
                )
            )
        opset = default_opset(model)
        if self.rewrite_rules and opset >= MIN_RULES_OPSET:
            # onnxscript's rules emit current-opset forms (e.g. Unsqueeze with an axes input)
            loop.append(RewritePass(DEFAULT_REWRITE_RULES))
        loop += [
            _SafeIdentityElimination(),
            common.RemoveUnusedNodesPass(),
            common.RemoveUnusedFunctionsPass(),
            common.RemoveUnusedOpsetsPass(),
        ]
        passes: list[ir.passes.PassBase] = []
        if self.inline:
            passes.append(_InlineForeignFunctions())
        passes.append(ir.passes.PassManager(loop, steps=max(1, self.iterations), early_stop=True))
        passes += [
            common.LiftConstantsToInitializersPass(lift_all_constants=False, size_limit=16),
            common.DeduplicateInitializersPass(),
        ]
        if self.cse:
            passes.append(common.CommonSubexpressionEliminationPass())
        passes += [common.RemoveUnusedNodesPass(), common.RemoveUnusedOpsetsPass()]
        if model.ir_version is not None and model.ir_version < 4:
            # IR < 4: every initializer must also be a graph input (folding may have made new ones)
            passes.append(common.AddInitializersToInputsPass())
        modified = False
        for p in passes:
            r = p(model)
            modified = modified or r.modified
        return modified


register(CleanupPass)
