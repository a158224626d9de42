"""``graphopt bench``: time models interleaved in one process, report ratios to the first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Calib, InputShape, InputValue, Json, Provider, feed_overrides

_GEN = "Decoders (--generate)"


def command(
    models: Annotated[list[Path], typer.Argument(help="ONNX models; ratios are against the first.", show_default=False)],
    calib: Calib = None,
    input_shape: InputShape = None,
    input_value: InputValue = None,
    batch: Annotated[int, typer.Option("--batch", help="Batch size of generated feeds (without --calib).")] = 1,
    seq: Annotated[int, typer.Option("--seq", help="Sequence length of generated feeds (without --calib).")] = 128,
    threads: Annotated[str | None, typer.Option(
        "--threads", help="ORT intra-op threads: one count, or a comma list (1,2,4) for throughput and scaling "
        "per count, each count interleaved on its own [default: 1; 1,2 with --generate].")] = None,
    rounds: Annotated[int | None, typer.Option("--rounds", help="Timed rounds (each runs every feed once per model) "
                                               "[default: 20; 3 with --generate].")] = None,
    warmup: Annotated[int | None, typer.Option("--warmup", help="Untimed rounds first [default: 2; 1 with "
                                               "--generate].")] = None,
    paired: Annotated[bool, typer.Option(
        "--paired", help="With --threads: all thread counts in one round-robin, each model's sessions back to "
        "back; scaling is the median over rounds of each round's ratio, and '÷ first' divides it by the first "
        "model's in the same round (phases of a noisy machine cancel). CPU only.")] = False,
    scale_by: Annotated[str, typer.Option(
        "--scale-by", help="With --paired: spend a count of N cores as N intra-op threads of one session "
        "(threads) or as N concurrent single-thread sessions (instances, how a service scales by model "
        "instances).")] = "threads",
    provider: Provider = "cpu",
    json_: Json = False,
    generate: Annotated[bool, typer.Option(
        "--generate", help="MODELS are decoders with past: time prefill and decode of a --context token prompt "
        "and --max-new-tokens greedy tokens against the baselines (--hf, --gguf).", rich_help_panel=_GEN)] = False,
    context: Annotated[int, typer.Option("--context", help="Prompt tokens.", rich_help_panel=_GEN)] = 128,
    prompt_file: Annotated[Path | None, typer.Option(
        "--prompt-file", help="Text whose first --context tokens are the prompt (default: a bundled held-out "
        "text).", rich_help_panel=_GEN)] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="New tokens (EOS ignored).",
                                                rich_help_panel=_GEN)] = 128,
    tokenizer: Annotated[Path | None, typer.Option(
        "--tokenizer", help="Tokenizer folder (default: beside the first model).", rich_help_panel=_GEN)] = None,
    hf: Annotated[Path | None, typer.Option(
        "--hf", help="Hugging Face folder: PyTorch eager fp32 reference and the ONNX Runtime GenAI builds.",
        rich_help_panel=_GEN)] = None,
    genai: Annotated[str, typer.Option(
        "--genai", help="GenAI builder precisions to run on --hf (comma list of fp32,int4, or none).",
        rich_help_panel=_GEN)] = "fp32,int4",
    gguf: Annotated[Path | None, typer.Option("--gguf", help="GGUF file for the llama.cpp baseline.",
                                              rich_help_panel=_GEN)] = None,
    ppl_text: Annotated[Path | None, typer.Option(
        "--ppl-text", help="Also report perplexity over non-overlapping windows of this text.",
        rich_help_panel=_GEN)] = None,
    ppl_window: Annotated[int, typer.Option("--ppl-window", help="Perplexity window (tokens).",
                                            rich_help_panel=_GEN)] = 512,
    rss: Annotated[bool, typer.Option(
        "--rss/--no-rss", help="Measure each variant's peak RSS in a process of its own first.",
        rich_help_panel=_GEN)] = True,
    report: Annotated[Path | None, typer.Option("--report", help="With --generate: write the JSON document to "
                                                "FILE.", metavar="FILE", rich_help_panel=_GEN)] = None,
    speculative: Annotated[str, typer.Option(
        "--speculative", help="With --generate: also run each model with this draft (auto, heads, layer-skip, lookup; auto takes "
        "the model's NAME.draft.onnx beside it first), interleaved with its plain decoding; adds accepted_per_step "
        "and the speed-up.", rich_help_panel=_GEN)] = "off",
    speculative_on: Annotated[str | None, typer.Option(
        "--speculative-on", help="With --speculative: only these models (comma list of file names or paths) also "
        "run with the draft [default: every model].", rich_help_panel=_GEN)] = None,
    pytorch: Annotated[bool, typer.Option(
        "--pytorch/--no-pytorch", help="With --hf: also run the PyTorch eager fp32 reference.",
        rich_help_panel=_GEN)] = True,
    draft: Annotated[Path | None, typer.Option(
        "--draft", help="With --generate: also run each model (or those --speculative-on names) with this draft "
        "decoder (the same tokenizer, e.g. the model's int4 build), interleaved with its plain decoding.",
        metavar="DRAFT.onnx", rich_help_panel=_GEN)] = None,
) -> None:
    """Benchmark MODELS interleaved round-robin (intra-op spinning off): p50/p90 per round,
    throughput (batch items per second) and each model's speed-up over the first.

    With --provider cuda the inputs are copied to the GPU once and outputs stay there (IO binding),
    after --warmup untimed rounds; without a working CUDA provider it fails in one line naming what is
    missing.

    With --threads 1,2,4 every thread count gets its own sessions and its own interleaved round-robin;
    the table adds each model's scaling (its throughput over its throughput at the first count). With
    --paired every count runs in one round-robin instead, a model's counts back to back, and scaling is
    taken round by round (the median of each round's ratio), also relative to the first model's;
    --scale-by instances spends N cores as N concurrent single-thread sessions instead of N threads.

    Each model's sessions use the ONNX Runtime settings recorded in its metadata by `graphopt optimize`
    (graph optimization level, execution mode, inter-op threads); --json lists them.

    With --generate, MODELS are decoders (see `graphopt generate`) and the baselines come from --hf
    (PyTorch, ONNX Runtime GenAI) and --gguf (llama.cpp); each missing one is skipped with its reason.

    Example: graphopt bench base.onnx opt.onnx --calib feeds/ --rounds 30 --threads 1,2

    Example: graphopt bench --generate model.onnx --hf hf/ --gguf model.gguf --threads 1,2 --report gen.json
    """
    import json

    from graphopt import io
    from graphopt.bench import (
        SCALE_BY,
        bench_thread_counts,
        bench_thread_pairs,
        model_settings,
        paired_scaling,
        scaling,
    )
    from graphopt.cli.console import make_console, table
    from graphopt.data import feeds as feeds_mod
    from graphopt.errors import UsageError

    if generate:
        from graphopt.cli import bench_generate

        bench_generate.run(models, tokenizer=tokenizer, hf=hf, genai=genai, gguf=gguf, context=context,
                           prompt_file=prompt_file, max_new_tokens=max_new_tokens,
                           threads=_thread_counts(threads or "1,2"), rounds=3 if rounds is None else rounds,
                           warmup=1 if warmup is None else warmup, ppl_text=ppl_text, ppl_window=ppl_window,
                           rss=rss, report=report, json_=json_, speculative=speculative,
                           speculative_on=None if speculative_on is None else [x for x in speculative_on.split(",") if x],
                           pytorch=pytorch, draft=draft)
        return
    if report is not None:
        raise UsageError("--report is for --generate; plain bench prints JSON with --json")
    threads = threads or "1"
    rounds = 20 if rounds is None else rounds
    warmup = 2 if warmup is None else warmup
    if rounds < 1:
        raise UsageError("--rounds must be at least 1")
    counts = _thread_counts(threads)
    if paired and (len(counts) < 2 or provider == "cuda"):
        raise UsageError("--paired compares thread counts on CPU: give --threads with two or more counts "
                         "and no --provider cuda")
    if scale_by not in SCALE_BY or (scale_by != "threads" and not paired):
        raise UsageError(f"--scale-by must be one of {', '.join(SCALE_BY)}, and instances needs --paired")
    if provider == "cuda":
        from graphopt.runtime.session import require_cuda

        require_cuda()  # before loading models or making feeds
    shapes, values = feed_overrides(input_shape, input_value, calib)
    feeds = feeds_mod.select(io.load(models[0]), calib=calib, shapes=shapes, values=values,
                             count=1, batch=batch, seq=seq, padded=False).feeds
    for m in models[1:]:
        io.load(m, check_external=True)  # fail early and clearly on a bad path
    names = {}
    for m in models:
        key = str(m)
        while key in names:
            key += "'"
        names[key] = str(m)
    if paired:
        per_count = bench_thread_pairs(names, feeds, counts, rounds=rounds, warmup=warmup, scale_by=scale_by)
        scale = paired_scaling(per_count)
        relative = paired_scaling(per_count, relative_to=next(iter(names)))
    else:
        per_count = bench_thread_counts(names, feeds, counts, rounds=rounds, warmup=warmup, provider=provider)
        scale, relative = scaling(per_count), None
    rows = []
    for n, results in per_count.items():
        for r in results:
            row = {**r.as_dict(results[0]), "threads": n}
            if len(counts) > 1:
                row["scaling"] = scale[n][r.name]
            if relative is not None:
                row["scaling_vs_first_model"] = relative[n][r.name]
            rows.append(row)
    if json_:
        typer.echo(json.dumps({"feeds": feeds_mod.describe(feeds), "threads": counts[0] if len(counts) == 1 else counts,
                               "paired": paired, "scale_by": scale_by,
                               "session_settings": {n: model_settings(p) for n, p in names.items()},
                               "results": rows}, indent=2))
        return
    right = {"justify": "right", "no_wrap": True}
    cols = [("model", {"no_wrap": True}), ("p50 ms", right), ("p90 ms", right), ("items/s", right), ("× first", right)]
    if len(counts) > 1:
        cols = [("threads", right), *cols, (f"scaling vs {counts[0]}t", right)]
    if relative is not None:
        cols.append(("÷ first's scaling", right))
    how = "all counts interleaved, scaling paired by round (medians)" if paired else "interleaved per thread count"
    if scale_by == "instances":
        how += "; a count N = N concurrent single-thread sessions"
    t = table(f"graphopt bench ({feeds_mod.describe(feeds)}; {','.join(map(str, counts))} thread(s), {how})", cols)
    for r in rows:
        cells = [r["model"], f"{r['p50_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['items_per_s']:.1f}",
                 f"{r['speedup_vs_first']:.3f}"]
        if len(counts) > 1:
            cells = [str(r["threads"]), *cells, f"{r['scaling']:.2f}x"]
        if relative is not None:
            cells.append(f"{r['scaling_vs_first_model']:.2f}")
        t.add_row(*cells)
    make_console().print(t)


def _thread_counts(text: str, flag: str = "--threads") -> list[int]:
    """``"1,2,4"`` → ``[1, 2, 4]``: positive, distinct, in the given order (errors name ``flag``)."""
    from graphopt.errors import UsageError

    try:
        counts = [int(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag}: expected a count or a comma list of counts (1,2,4), got {text!r}") from None
    if any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise UsageError(f"{flag}: counts must be distinct and at least 1, got {text!r}")
    return counts
