"""``bench --generate``: decoders and their peers generating the same prompt, interleaved round-robin.

Per thread count every variant (each graphopt ONNX decoder; PyTorch eager fp32 on ``hf``; ONNX Runtime GenAI's
builder outputs of ``hf``; llama.cpp on ``gguf``) is loaded into this one process, then
:func:`graphopt.bench.harness.round_robin` runs one whole generation per variant per round, the order rotating,
after ``warmup`` untimed rounds; the variants are dropped before the next thread count loads. Batch 1; the
prompt is the first ``context`` tokens of a text (the tokenizer beside the first model), the same ids for all;
every variant makes ``max_new_tokens`` greedy tokens with the end-of-sequence ids masked.

Per row (variant x thread count), medians over the timed rounds: ``prefill_ms`` (time to first token),
``prefill_tokens_per_s`` (context / prefill), ``decode_tokens_per_s`` (new tokens after the first over first ->
last). ``peak_rss_mb``: the peak RSS of a process of its own that loads the variant and generates once
(:mod:`graphopt.bench.rss_probe`, before the timing, at the first thread count; ``rss=False`` skips it).
``kv_bytes_per_token``: keys and values of one position over all layers, in the variant's cache dtype.
``greedy_agreement``: the common prefix of its tokens and the reference's (PyTorch when it runs, else the first
model). ``ppl`` (with a perplexity text): :mod:`graphopt.bench.perplexity`, once per variant, at the first thread count.

Ratios against the first model (``ratio_vs``), the baseline of the run: ``ppl_ratio`` (its perplexity over the
first's) and ``decode_ratio``, the median over the timed rounds of its decode tokens/s over the first's in the same
round; ``decode_tokens_per_s_rounds`` keeps every timed round's rate, so any two rows give a per-round ratio.
A long ``context`` (a prompt file of that many tokens) times decode after that many prefilled positions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from graphopt.bench.decoders import Run, Variant
from graphopt.bench.harness import median, percentile, round_robin
from graphopt.bench.peers import build_variant, genai_build
from graphopt.bench.perplexity import DEFAULT_WINDOW, perplexity, read_text
from graphopt.bench.rss_probe import probe
from graphopt.errors import GraphoptError, MissingFileError, UsageError
from graphopt.generate import chat as tokens_mod
from graphopt.generate.loop import decoder_file

logger = logging.getLogger(__name__)

REFERENCE = "pytorch-fp32"
#: optional runtime -> (module, install hint)
RUNTIMES = {"pytorch": ("torch", "pip install torch transformers"),
            "onnxruntime-genai": ("onnxruntime_genai", "pip install onnxruntime-genai"),
            "llama.cpp": ("llama_cpp", "pip install llama-cpp-python")}


def missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


@dataclasses.dataclass
class Spec:
    """A variant to load at a thread count: its kind and keyword arguments (plain JSON values)."""

    kind: str
    args: dict

    @property
    def name(self) -> str:
        return self.args["name"]

    def make(self, threads: int) -> Variant:
        return build_variant(self.kind, threads=threads, **self.args)


@dataclasses.dataclass
class _Measured:
    variant: Variant
    runs: list[Run] = dataclasses.field(default_factory=list)


def prompt_ids(tokenizer, text: str, context: int, source: str) -> list[int]:
    """The first ``context`` token ids of ``text`` (no special tokens); UsageError when it is shorter."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if context < 1 or len(ids) < context:
        raise UsageError(f"{source}: {len(ids)} tokens, fewer than --context {context}",
                         hint="give a longer --prompt-file or a smaller --context")
    return ids[:context]


def specs(models: Sequence[Path], *, stop_ids: Sequence[int], pad_id: int, hf: Path | None,
          genai: Sequence[str], gguf: Path | None, n_ctx: int, skipped: list[dict],
          speculative: str = "off", speculative_on: Sequence[str] | None = None, pytorch: bool = True,
          draft: Path | None = None) -> list[Spec]:
    """What to load, in table order; every baseline that cannot run is added to ``skipped`` with its reason.
    ``speculative_on``: the models (file names or paths) that also run with the draft (None: every model);
    ``draft``: a draft decoder file, the draft of those models (``speculative`` is then "draft", or
    "lookup+draft": prompt lookup where the text repeats, the draft model elsewhere)."""
    wanted = None if speculative_on is None else {str(x) for x in speculative_on}
    if wanted is not None:
        unknown = wanted - {m.name for m in models} - {str(m) for m in models}
        if unknown:
            raise UsageError(f"--speculative-on: {sorted(unknown)[0]} is none of the models",
                             hint="name a model by its file name or its path as given")
    out: list[Spec] = []
    seen: set[str] = set()
    for m in models:
        name = m.name
        while name in seen:
            name += "'"
        seen.add(name)
        out.append(Spec("graphopt", {"path": str(m), "name": name, "stop_ids": list(stop_ids)}))
        if speculative != "off" and (wanted is None or m.name in wanted or str(m) in wanted):
            # the same model with a draft, interleaved with its plain decoding
            args = {"path": str(m), "name": f"{name} +{speculative}", "stop_ids": list(stop_ids),
                    "speculative": speculative}
            if draft is not None:
                args["draft"] = str(draft)
            out.append(Spec("graphopt", args))

    def skip(name: str, why: str) -> None:
        skipped.append({"name": name, "reason": why})
        logger.warning("%s skipped: %s", name, why)

    if hf is None:
        skip(REFERENCE, "no --hf DIR given")
        for p in genai:
            skip(f"genai-{p}", "no --hf DIR given (the GenAI builder runs on it)")
    else:
        if not pytorch:
            skip(REFERENCE, "--no-pytorch")
        elif missing("torch") or missing("transformers"):
            skip(REFERENCE, f"torch/transformers are not installed ({RUNTIMES['pytorch'][1]})")
        else:
            out.append(Spec("pytorch", {"folder": str(hf), "name": REFERENCE, "stop_ids": list(stop_ids),
                                        "pad_id": pad_id}))
        for p in genai:
            name = f"genai-{p}"
            if missing("onnxruntime_genai"):
                skip(name, f"onnxruntime_genai is not installed ({RUNTIMES['onnxruntime-genai'][1]})")
                continue
            try:
                folder = genai_build(hf, p)
            except GraphoptError as e:
                skip(name, str(e))
                continue
            out.append(Spec("onnxruntime-genai", {"folder": str(folder), "name": name}))
    if gguf is None:
        skip("llama.cpp", "no --gguf FILE given")
    elif missing("llama_cpp"):
        skip("llama.cpp", f"llama_cpp is not installed ({RUNTIMES['llama.cpp'][1]})")
    elif not gguf.is_file():
        skip("llama.cpp", f"{gguf}: no such file")
    else:
        name = f"llama.cpp-{gguf.stem.rsplit('.', 1)[-1]}" if "." in gguf.stem else "llama.cpp"
        out.append(Spec("llama.cpp", {"gguf": str(gguf), "name": name, "stop_ids": list(stop_ids), "n_ctx": n_ctx}))
    return out


def _turn(m: _Measured, prompt: list[int], max_new: int) -> Callable[[], None]:
    def go() -> None:
        m.runs.append(m.variant.generate(prompt, max_new))
    return go


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def speculative_row(row: dict, m: _Measured, loaded: dict[str, _Measured], warmup: int) -> None:
    """For a model run with a draft: ``accepted_per_step`` (median over the timed rounds) and ``speedup``, the
    median over rounds of its decode tokens/s over its plain decoding's in the same round."""
    mode = getattr(m.variant, "speculative", "off")
    if mode == "off":
        return
    runs = m.runs[warmup:]
    row["speculative"] = mode
    row["accepted_per_step"] = median([r.accepted_per_step or 0.0 for r in runs])
    plain = loaded.get(m.variant.name.removesuffix(f" +{mode}"))
    if plain is None:
        return
    pairs = [(a.decode_tokens_per_s, b.decode_tokens_per_s) for a, b in zip(runs, plain.runs[warmup:])]
    ratios = [a / b for a, b in pairs if a and b]
    row["speedup"] = median(ratios) if ratios else None
    row["speedup_vs"] = plain.variant.name
    row["tokens_equal_plain"] = all(a.tokens == b.tokens for a, b in zip(runs, plain.runs[warmup:]))


def ratio_row(row: dict, m: _Measured, first: _Measured, warmup: int) -> None:
    """``ppl_ratio`` and ``decode_ratio`` (per round, median) of ``m`` against the run's first model."""
    row["ratio_vs"] = first.variant.name
    pairs = zip(m.runs[warmup:], first.runs[warmup:])
    ratios = [a.decode_tokens_per_s / b.decode_tokens_per_s for a, b in pairs
              if a.decode_tokens_per_s and b.decode_tokens_per_s]
    row["decode_ratio"] = median(ratios) if ratios else None


def _ppl_ratios(rows: list[dict]) -> None:
    base = {r["threads"]: r.get("ppl") for r in rows if r["name"] == r["ratio_vs"]}
    for r in rows:
        b = base.get(r["threads"])
        r["ppl_ratio"] = r["ppl"] / b if r.get("ppl") and b else None


def _row(m: _Measured, threads: int, warmup: int, context: int, peak: float | None) -> dict:
    runs = m.runs[warmup:]
    v = m.variant
    prefill = [r.prefill_s for r in runs]
    rates = [r.decode_tokens_per_s for r in runs if r.decode_tokens_per_s]
    row = {
        "name": v.name, "kind": v.kind, "model": v.model, "threads": threads,
        "prefill_ms": 1e3 * median(prefill), "prefill_ms_p90": 1e3 * percentile(prefill, 90),
        "prefill_tokens_per_s": context / median(prefill),
        "decode_tokens_per_s": median(rates) if rates else None,
        "decode_tokens_per_s_p10": percentile(rates, 10) if rates else None,
        "decode_tokens_per_s_rounds": [r.decode_tokens_per_s for r in runs],
        "rounds": len(runs), "new_tokens": len(runs[0].tokens),
        "peak_rss_mb": peak,
        "kv_bytes_per_token": v.kv_bytes_per_token,
        "deterministic": all(r.tokens == runs[0].tokens for r in runs),
    }
    return row


def bench_generate(
    models: Sequence[str | os.PathLike],
    *,
    tokenizer: str | os.PathLike | None = None,
    hf: str | os.PathLike | None = None,
    genai: Sequence[str] = ("fp32", "int4"),
    gguf: str | os.PathLike | None = None,
    context: int = 128,
    prompt_file: str | os.PathLike | None = None,
    max_new_tokens: int = 128,
    threads: Sequence[int] = (1, 2),
    rounds: int = 3,
    warmup: int = 1,
    ppl_text: str | os.PathLike | None = None,
    ppl_window: int = DEFAULT_WINDOW,
    rss: bool = True,
    on_row: Callable[[dict], None] | None = None,
    speculative: str = "off",
    speculative_on: Sequence[str] | None = None,
    pytorch: bool = True,
    draft: str | os.PathLike | None = None,
) -> dict:
    """Benchmark decoders and their peers (module docstring); returns the JSON document."""
    # spinning off for the OpenMP pools too (llama.cpp's, PyTorch's), as for ORT's: read when they load
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    models = [Path(m) for m in models]
    if not models:
        raise UsageError("bench --generate needs at least one ONNX decoder")
    for m in models:
        if not m.is_file():
            raise MissingFileError(f"{m}: no such file")
    if draft is not None:
        draft = decoder_file(draft)
        if speculative not in ("off", "draft", "lookup", "lookup+draft"):
            raise UsageError(f"--draft runs the draft model; --speculative {speculative} names another draft",
                             hint="give --speculative lookup (lookup where the text repeats, the model elsewhere) "
                                  "or leave it out")
        speculative = "lookup+draft" if speculative.startswith("lookup") else "draft"
    elif speculative in ("draft", "lookup+draft"):
        raise UsageError(f"--speculative {speculative} needs --draft DRAFT.onnx")
    if rounds < 1 or warmup < 0 or max_new_tokens < 1:
        raise UsageError("--rounds and --max-new-tokens must be at least 1, --warmup at least 0")
    hf = Path(hf) if hf is not None else None
    if hf is not None and not (hf / "config.json").is_file():
        raise UsageError(f"{hf}: not a Hugging Face folder (no config.json)")
    folder = tokens_mod.tokenizer_folder(models[0], tokenizer)
    tok = tokens_mod.load_tokenizer(folder)
    source = str(prompt_file) if prompt_file else "the bundled held-out text"
    prompt = prompt_ids(tok, read_text(prompt_file), context, source)
    stops = tokens_mod.stop_ids(tok, folder, models[0].parent)
    ppl_ids = list(tok(read_text(ppl_text), add_special_tokens=False)["input_ids"]) if ppl_text else None
    skipped: list[dict] = []
    spec_list = specs(models, stop_ids=stops, pad_id=tokens_mod.pad_id(tok), hf=hf, genai=genai,
                      gguf=Path(gguf) if gguf else None, n_ctx=max(context + max_new_tokens, ppl_window) + 8,
                      skipped=skipped, speculative=speculative, speculative_on=speculative_on, pytorch=pytorch,
                      draft=draft)
    peaks: dict[str, float | None] = {}
    if rss:  # before any timing: one process per variant, one after another
        for sp in spec_list:
            try:
                peaks[sp.name] = probe(sp.kind, threads[0], sp.args, prompt, max_new_tokens)
            except GraphoptError as e:
                logger.warning("%s: %s", sp.name, e)
    rows: list[dict] = []
    ppl: dict[str, dict] = {}
    for t in threads:
        loaded = {sp.name: _Measured(sp.make(t)) for sp in spec_list}
        try:
            round_robin({n: _turn(m, prompt, max_new_tokens) for n, m in loaded.items()}, rounds=rounds,
                        warmup=warmup)
            if ppl_ids is not None and not ppl:
                for n, m in loaded.items():
                    try:
                        ppl[n] = perplexity(m.variant.window_logits, ppl_ids, ppl_window).as_dict()
                    except (GraphoptError, NotImplementedError, ValueError) as e:
                        ppl[n] = {"ppl": None, "ppl_error": str(e).splitlines()[0]}
            ref_name = REFERENCE if REFERENCE in loaded else next(iter(loaded))
            ref = loaded[ref_name].runs[warmup].tokens
            first = next(iter(loaded.values()))
            for m in loaded.values():
                row = _row(m, t, warmup, context, peaks.get(m.variant.name))
                row["greedy_agreement"] = common_prefix(m.runs[warmup].tokens, ref)
                row["agreement_vs"] = ref_name
                row.update(ppl.get(m.variant.name, {}))
                speculative_row(row, m, loaded, warmup)
                ratio_row(row, m, first, warmup)
                rows.append(row)
            _ppl_ratios(rows)
            for row in rows[len(rows) - len(loaded):]:
                if on_row is not None:
                    on_row(row)
        finally:
            for m in loaded.values():
                m.variant.close()
            loaded.clear()
    return {
        "context": context, "max_new_tokens": max_new_tokens, "batch": 1, "prompt_source": source,
        "prompt_ids": prompt, "stop_ids_masked": stops, "threads": list(threads), "rounds": rounds,
        "warmup": warmup, "process": "one process; per thread count all variants loaded, round-robin",
        "ppl_text": str(ppl_text) if ppl_text else None, "ppl_window": ppl_window if ppl_text else None,
        "rss": f"peak RSS of a process of its own per variant, at {threads[0]} thread(s)" if rss else None,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "load_average": list(os.getloadavg()),
        "speculative": speculative, "draft": str(draft) if draft is not None else None,
        "skipped": skipped, "results": rows,
    }
