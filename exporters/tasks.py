"""Export tasks: which Hugging Face head a task loads, and the ONNX signature it gets.

Each task names a transformers auto class (looked up by the config's ``model_type``) and the
outputs the exported graph returns. The wrappers here turn a transformers model into a module with
positional tensor inputs and a tuple of tensor outputs, which both exporters handle.

Signatures (dynamic axes in brackets):

=========================  =============================================  ==========================================
task                       inputs                                         outputs
=========================  =============================================  ==========================================
feature-extraction         input_ids, attention_mask[, token_type_ids]    last_hidden_state [batch, sequence, hidden]
sequence-classification    same                                           logits [batch, labels]
token-classification       same                                           logits [batch, sequence, labels]
masked-lm                  same                                           logits [batch, sequence, vocab]
causal-lm                  input_ids, attention_mask                      logits [batch, sequence, vocab]
causal-lm-with-past        + past_key_values.N.key/value                  + present.N.key/value
                           [batch, kv_heads, past_sequence, head_dim];
                           attention_mask [batch, past_sequence+sequence]
=========================  =============================================  ==========================================
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect

from graphopt.errors import UsageError


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One export task."""

    name: str
    auto_class: str  # transformers class name
    mapping: str  # the modeling_auto *_MAPPING_NAMES dict listing supported model types
    output: str  # the main output's name
    seq_output: bool  # main output has a sequence axis
    with_past: bool = False


TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in [
        TaskSpec("feature-extraction", "AutoModel", "MODEL_MAPPING_NAMES", "last_hidden_state", True),
        TaskSpec(
            "sequence-classification",
            "AutoModelForSequenceClassification",
            "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            "logits",
            False,
        ),
        TaskSpec(
            "token-classification",
            "AutoModelForTokenClassification",
            "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
            "logits",
            True,
        ),
        TaskSpec("masked-lm", "AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "logits", True),
        TaskSpec("causal-lm", "AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "logits", True),
        TaskSpec(
            "causal-lm-with-past",
            "AutoModelForCausalLM",
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "logits",
            True,
            with_past=True,
        ),
    ]
}


def get_task(name: str) -> TaskSpec:
    """The TaskSpec called ``name``; UsageError listing the tasks otherwise."""
    spec = TASKS.get(name)
    if spec is None:

        close = difflib.get_close_matches(name, list(TASKS), n=1)
        hint = (f"did you mean {close[0]!r}? " if close else "") + "tasks: " + ", ".join(TASKS)
        raise UsageError(f"unknown task {name!r}", hint=hint)
    return spec


def supported_tasks(model_type: str) -> list[str]:
    """Tasks transformers has a head for, for this ``model_type``."""
    from transformers.models.auto import modeling_auto

    return [t.name for t in TASKS.values() if model_type in getattr(modeling_auto, t.mapping, {})]


def check_supported(spec: TaskSpec, model_type: str, src: str) -> None:
    """UsageError when transformers has no ``spec`` head for ``model_type``."""
    ok = supported_tasks(model_type)
    if spec.name not in ok:
        raise UsageError(
            f"{src}: task {spec.name!r} is not available for model type {model_type!r}",
            hint="tasks for this model: " + (", ".join(ok) or "none"),
        )


def make_wrapper(model, spec: TaskSpec, input_names: list[str], num_layers: int = 0):
    """A torch module taking ``input_names`` positionally and returning a tuple of outputs."""
    import torch

    class _Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            kwargs = {n: args[i] for i, n in enumerate(input_names)}
            out = self.inner(**kwargs, use_cache=False) if spec.auto_class == "AutoModelForCausalLM" else self.inner(**kwargs)
            return (getattr(out, spec.output),)

    class _WithPast(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            from transformers import DynamicCache

            input_ids, attention_mask, past = args[0], args[1], args[2:]
            pairs = [(past[2 * i], past[2 * i + 1]) for i in range(num_layers)]
            cache = DynamicCache(pairs, config=self.inner.config)
            # transformers >= 5.2x calls the cache argument ``cache`` (``past_key_values`` before)
            key = "cache" if cache_kw == "cache" else "past_key_values"
            out = self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **{key: cache})
            present = getattr(out, key)
            if present is None:
                raise RuntimeError(f"{type(self.inner).__name__} returns no key/value cache; it cannot run with past")
            flat = []
            for i in range(num_layers):
                layer = present.layers[i]
                flat += [layer.keys, layer.values]
            return (out.logits, *flat)


    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return _WithPast(model) if spec.with_past else _Plain(model)
