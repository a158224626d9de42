"""What gets exported: a Hugging Face model folder or a ``module:function``, prepared for export.

``prepare`` turns SRC into a :class:`Prepared`: a torch module with positional tensor inputs and a
tuple of outputs, its input/output names, the dynamic axes, an example input for tracing and the
feeds the parity gate runs (a right-padded batch of mixed lengths, real tokens when the folder has
a tokenizer, and a second batch size and length to exercise the dynamic axes).

``module:function``: ``function()`` returns ``(module, example_inputs)`` or
``(module, example_inputs, dynamic_axes)``, with ``example_inputs`` a dict ``name -> tensor`` passed
as keyword arguments and ``dynamic_axes`` ``{name: {axis: dim_name}}`` (default: axis 0 is
``batch``, axis 1 of inputs of rank >= 2 is ``sequence``). ``module`` is a dotted module name or a
path to a ``.py`` file.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from graphopt.errors import ExportError, UsageError, first_line
from graphopt.exporters.tasks import TaskSpec, check_supported, make_wrapper

logger = logging.getLogger(__name__)

#: sentences tokenized for the parity check when the model folder has a tokenizer
PARITY_TEXTS = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank this morning.",
    "ONNX Runtime runs the exported graph.",
    "Hello!",
]


@dataclasses.dataclass
class Prepared:
    """A source ready to export."""

    module: Any  # torch.nn.Module: forward(*inputs) -> tuple of tensors
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]  # inputs and outputs
    example: tuple  # torch tensors, one per input
    feeds: list[dict[str, np.ndarray]]  # parity feeds
    attn: str | None  # attention implementation, None when unknown
    kind: str  # "hf" or "callable"
    reference: Any = None  # module computing the reference outputs (fp32 copy when exporting fp16)
    dim_hints: dict[str, str] = dataclasses.field(default_factory=dict)  # dim name -> "dynamic" (dynamo)


def _is_callable_spec(src: str) -> bool:
    if Path(src).exists():
        return False
    head, sep, tail = src.rpartition(":")
    return bool(sep and head and tail.isidentifier() and not (len(head) == 1 and head.isalpha()))


def prepare(src: str | os.PathLike, spec: TaskSpec, *, attn: str | None = None, dtype: str = "fp32") -> Prepared:
    """Load ``src`` (HF folder or ``module:function``) for ``spec``."""
    s = str(src)
    if _is_callable_spec(s):
        if attn:
            logger.warning("%s: --attn %s ignored; a module:function source sets its own attention", s, attn)
        return _prepare_callable(s, spec, dtype)
    return _prepare_hf(Path(s), spec, attn, dtype)


# ------------------------------------------------------------------ Hugging Face folders


def _prepare_hf(folder: Path, spec: TaskSpec, attn: str | None, dtype: str) -> Prepared:
    import torch
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()
    if not folder.exists():
        raise UsageError(
            f"{folder}: no such folder",
            hint="SRC is a Hugging Face model folder (config.json + weights) or module:function",
        )
    if not folder.is_dir() or not (folder / "config.json").is_file():
        raise ExportError(
            f"{folder}: no config.json, not a Hugging Face model folder",
            hint="save the model with save_pretrained(), or pass module:function",
        )
    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except Exception as e:
        raise ExportError(f"{folder / 'config.json'}: cannot read the config: {_first_line(e)}") from e
    check_supported(spec, config.model_type, str(folder))
    cls = getattr(transformers, spec.auto_class)
    kwargs: dict[str, Any] = {"output_loading_info": True, "dtype": torch.float32}
    if attn:
        kwargs["attn_implementation"] = attn
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # the load report is ours to summarise
    try:
        model, info = cls.from_pretrained(folder, **kwargs)
    except Exception as e:
        why = _first_line(e)
        if "mismatch" in why.lower() or "size" in why.lower():
            why = "tensor sizes differ from config.json"
        raise ExportError(
            f"{folder}: weights do not load into {config.model_type} ({spec.auto_class}): {why}",
            hint="the weights must come from a model with this config.json (sizes, layer count)",
        ) from e
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    _check_loading_info(folder, model, info, spec)
    model.eval()
    attn_used = getattr(model.config, "_attn_implementation", None) or attn
    num_layers = int(getattr(config, "num_hidden_layers", 0) or 0)

    sig = inspect.signature(model.forward).parameters
    names = ["input_ids", "attention_mask"]
    if not spec.with_past and getattr(config, "type_vocab_size", 0) and "token_type_ids" in sig:
        names.append("token_type_ids")
    axes: dict[str, dict[int, str]] = {n: {0: "batch", 1: "sequence"} for n in names}
    outputs = [spec.output]
    axes[spec.output] = {0: "batch", 1: "sequence"} if spec.seq_output else {0: "batch"}
    hints: dict[str, str] = {}
    if spec.with_past:
        axes["attention_mask"] = {0: "batch", 1: "past_sequence+sequence"}
        hints["past_sequence+sequence"] = "dynamic"
        for i in range(num_layers):
            for kv in ("key", "value"):
                names.append(f"past_key_values.{i}.{kv}")
                axes[names[-1]] = {0: "batch", 2: "past_sequence"}
        for i in range(num_layers):
            for kv in ("key", "value"):
                outputs.append(f"present.{i}.{kv}")
                axes[outputs[-1]] = {0: "batch", 2: "past_sequence+sequence"}

    vocab = int(getattr(config, "vocab_size", 0) or 0)
    ref = make_wrapper(model, spec, names, num_layers)
    module = ref
    if dtype == "fp16":

        module = make_wrapper(copy.deepcopy(model).half(), spec, names, num_layers)
    feeds, example = _hf_feeds(folder, config, names, spec, vocab, num_layers)
    module.eval()
    return Prepared(
        module=module,
        input_names=names,
        output_names=outputs,
        dynamic_axes=axes,
        example=example,
        feeds=feeds,
        attn=attn_used,
        kind="hf",
        reference=ref,
        dim_hints=hints,
    )


def _check_loading_info(folder: Path, model, info: dict, spec: TaskSpec) -> None:
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        k = mismatched[0]
        raise ExportError(
            f"{folder}: weights do not match config.json: {k[0] if isinstance(k, tuple) else k} has another shape",
            hint="the weights must come from a model with this config",
        )
    missing = sorted(info.get("missing_keys") or [])
    if not missing:
        return
    prefix = getattr(model, "base_model_prefix", "") + "."
    # A task head new to the checkpoint (e.g. a classifier on a base encoder) starts random: warn.
    # Missing weights inside the base model mean the checkpoint is not this model: fail.
    # (A base model's pooler is not part of last_hidden_state, so it counts as a head here.)
    if spec.auto_class == "AutoModel":
        base_missing = [k for k in missing if not k.startswith("pooler.")]
    else:
        base_missing = [k for k in missing if k.startswith(prefix)]
    if base_missing:
        raise ExportError(
            f"{folder}: weights do not match config.json: {len(base_missing)} tensors missing "
            f"(first: {base_missing[0]!r})",
            hint="the weights must come from a model with this config",
        )
    logger.warning("%s: %d head tensors are not in the checkpoint and start random: %s", folder, len(missing), ", ".join(missing[:4]))


def _tokenize(folder: Path, names: list[str], vocab: int) -> dict[str, np.ndarray] | None:
    has_tok = any((folder / f).is_file() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json"))
    if not has_tok:
        return None
    try:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(folder)
        enc = tok(PARITY_TEXTS, padding=True, return_tensors="np")
    except Exception as e:  # a broken tokenizer only costs real tokens
        logger.warning("%s: tokenizer not usable for the parity feeds (%s); using random ids", folder, _first_line(e))
        return None
    ids = enc["input_ids"].astype(np.int64)
    if vocab and ids.max() >= vocab:
        return None
    feed = {"input_ids": ids, "attention_mask": enc["attention_mask"].astype(np.int64)}
    if "token_type_ids" in names:
        feed["token_type_ids"] = enc.get("token_type_ids", np.zeros_like(ids)).astype(np.int64)
    return feed


def _random_feed(names, rng, batch, lengths, vocab, seq=None):
    seq = seq or max(lengths)
    low = min(5, max(vocab - 1, 0))
    ids = rng.integers(low, max(vocab, low + 1), size=(batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
    ids = np.where(mask == 1, ids, 0)
    feed = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in names:
        feed["token_type_ids"] = np.zeros_like(ids)
    return feed


def _hf_feeds(folder, config, names, spec: TaskSpec, vocab, num_layers):
    import torch

    rng = np.random.default_rng(0)
    if spec.with_past:
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)

        def feed(batch, past, seq, left_pad=()):
            f = _random_feed(names, rng, batch, [seq] * batch, vocab)
            mask = np.ones((batch, past + seq), dtype=np.int64)
            for b, n in enumerate(left_pad):
                mask[b, :n] = 0
            f["attention_mask"] = mask
            for i in range(num_layers):
                for kv in ("key", "value"):
                    f[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, kv_heads, past, head_dim)).astype(np.float32)
            return f

        feeds = [feed(3, 5, 4, left_pad=(0, 2, 3)), feed(1, 2, 1)]
        ex = feed(2, 4, 3)
    else:
        real = _tokenize(folder, names, vocab)
        feeds = [real] if real is not None else []
        feeds += [_random_feed(names, rng, 3, [12, 9, 4], vocab), _random_feed(names, rng, 1, [5], vocab)]
        ex = _random_feed(names, rng, 2, [8, 6], vocab)
    example = tuple(torch.from_numpy(ex[n]) for n in names)
    return feeds, example


# ------------------------------------------------------------------ module:function


def _load_callable(src: str):
    mod_name, _, fn_name = src.rpartition(":")
    try:
        if mod_name.endswith(".py") or os.sep in mod_name or "/" in mod_name:
            path = Path(mod_name)
            if not path.is_file():
                raise UsageError(f"{src}: no such file {path}", hint="SRC is a model folder or module:function")
            # a private module object, not entered in sys.modules (that would shadow or be shadowed
            # by any other module of the same name in this process)
            sp = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(sp)
            sp.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except UsageError:
        raise
    except ImportError as e:
        raise UsageError(f"{src}: cannot import module {mod_name!r}: {_first_line(e)}",
                         hint="SRC is a model folder or module:function importable from here") from e
    except Exception as e:
        raise ExportError(f"{src}: importing {mod_name!r} failed: {type(e).__name__}: {_first_line(e)}") from e
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise UsageError(f"{src}: module {mod_name!r} has no function {fn_name!r}",
                         hint="the function returns (torch.nn.Module, example_inputs dict)")
    return fn


def _prepare_callable(src: str, spec: TaskSpec, dtype: str) -> Prepared:
    import torch

    fn = _load_callable(src)
    try:
        got = fn()
    except Exception as e:
        raise ExportError(f"{src}: the function raised {type(e).__name__}: {_first_line(e)}") from e
    if not isinstance(got, tuple) or len(got) not in (2, 3) or not isinstance(got[0], torch.nn.Module) \
            or not isinstance(got[1], dict):
        raise ExportError(f"{src}: expected (torch.nn.Module, example_inputs dict[, dynamic_axes]), got {type(got).__name__}")
    inner, inputs, user_axes = got[0], dict(got[1]), (got[2] if len(got) == 3 else None)
    names = list(inputs)
    inner.eval()
    with torch.no_grad():
        try:
            out = inner(**inputs)
        except Exception as e:
            raise ExportError(f"{src}: the module fails on its example inputs: {type(e).__name__}: {_first_line(e)}") from e
    out_names, picker = _output_layout(out, spec)

    class _Callable(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *args):
            return picker(self.m(**{n: args[i] for i, n in enumerate(names)}))

    axes: dict[str, dict[int, str]] = {}
    for n, t in inputs.items():
        axes[n] = {0: "batch", 1: "sequence"} if t.dim() >= 2 else ({0: "batch"} if t.dim() == 1 else {})
    first = next(iter(inputs.values()))
    b = first.shape[0] if first.dim() else None
    s = first.shape[1] if first.dim() >= 2 else None
    for n, t in zip(out_names, picker(out), strict=True):
        ax = {}
        if t.dim() >= 1 and t.shape[0] == b:
            ax[0] = "batch"
        if t.dim() >= 2 and s is not None and t.shape[1] == s:
            ax[1] = "sequence"
        axes[n] = ax
    if user_axes:
        axes.update({k: {int(a): str(d) for a, d in v.items()} for k, v in user_axes.items()})

    ref = _Callable(inner)
    module = ref
    if dtype == "fp16":

        module = _Callable(copy.deepcopy(inner).half())
    ex = {n: (t.half() if dtype == "fp16" and t.is_floating_point() else t) for n, t in inputs.items()}
    feeds = [{n: t.detach().numpy() for n, t in ex.items()}]
    doubled = {n: (np.concatenate([v, v]) if 0 in axes.get(n, {}) else v) for n, v in feeds[0].items()}
    if "attention_mask" in doubled and doubled["attention_mask"].ndim == 2 and doubled["attention_mask"].shape[1] > 2:
        m = doubled["attention_mask"].copy()
        m[-1, m.shape[1] // 2:] = 0
        doubled["attention_mask"] = m
    feeds.append(doubled)
    return Prepared(
        module=module,
        input_names=names,
        output_names=out_names,
        dynamic_axes=axes,
        example=tuple(ex[n] for n in names),
        feeds=feeds,
        attn=None,
        kind="callable",
        reference=ref,
    )


def _output_layout(out, spec: TaskSpec):
    """Output names and a function flattening the module's output to a tuple of tensors."""
    import torch

    if isinstance(out, torch.Tensor):
        return [spec.output], lambda o: (o,)
    if isinstance(out, dict):  # includes transformers ModelOutput
        keys = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        return keys, lambda o: tuple(o[k] for k in keys)
    if isinstance(out, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in out):
        n = len(out)
        names = [spec.output] if n == 1 else [f"output_{i}" for i in range(n)]
        return names, lambda o: tuple(o)
    raise ExportError(f"module output of type {type(out).__name__} is not a tensor, tuple of tensors or dict")


def _first_line(e: BaseException) -> str:
    s = str(e)
    if "## Exception summary" in s:  # torch.onnx's long report: keep the cause
        tail = s.split("## Exception summary", 1)[1].replace("\x1b[96m", "").replace("\x1b[0m", "")
        return first_line(tail, 300) or type(e).__name__
    return first_line(e, 300)
