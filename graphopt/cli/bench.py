"""``graphopt bench``: time models interleaved in one process, report ratios to the first."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Calib, InputShape, InputValue, Json, Provider, Threads, feed_overrides


def command(
    models: Annotated[list[Path], typer.Argument(help="ONNX models; ratios are against the first.", show_default=False)],
    calib: Calib = None,
    input_shape: InputShape = None,
    input_value: InputValue = None,
    batch: Annotated[int, typer.Option("--batch", help="Batch size of generated feeds (without --calib).")] = 1,
    seq: Annotated[int, typer.Option("--seq", help="Sequence length of generated feeds (without --calib).")] = 128,
    threads: Threads = 1,
    rounds: Annotated[int, typer.Option("--rounds", help="Timed rounds (each runs every feed once per model).")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed rounds first.")] = 2,
    provider: Provider = "cpu",
    json_: Json = False,
) -> None:
    """Benchmark MODELS interleaved round-robin (intra-op spinning off): p50/p90 per round,
    throughput (batch items per second) and each model's speed-up over the first.

    With --provider cuda the inputs are copied to the GPU once and outputs stay there (IO binding),
    after --warmup untimed rounds; without a working CUDA provider it fails in one line naming what is
    missing.

    Example: graphopt bench base.onnx opt.onnx --calib feeds/ --rounds 30
    """
    import json

    from graphopt import feeds as feeds_mod
    from graphopt import io
    from graphopt.bench import bench_models
    from graphopt.cli.console import make_console, table
    from graphopt.errors import UsageError

    if rounds < 1:
        raise UsageError("--rounds must be at least 1")
    if provider == "cuda":
        from graphopt.runtime import require_cuda

        require_cuda()  # before loading models or making feeds
    shapes, values = feed_overrides(input_shape, input_value, calib)
    first = io.load(models[0])
    if calib is not None:
        feeds = feeds_mod.load_dir(calib)
        feeds_mod.check_against(first, feeds)
    else:
        feeds, _ = feeds_mod.runnable(first, count=1, batch=batch, seq=seq, padded=False, shapes=shapes, values=values)
    for m in models[1:]:
        io.load(m, check_external=True)  # fail early and clearly on a bad path
    names = {}
    for m in models:
        key = str(m)
        while key in names:
            key += "'"
        names[key] = str(m)
    results = bench_models(names, feeds, threads=threads, rounds=rounds, warmup=warmup, provider=provider)
    base = results[0]
    rows = [r.as_dict(base) for r in results]
    if json_:
        typer.echo(json.dumps({"feeds": feeds_mod.describe(feeds), "threads": threads, "results": rows}, indent=2))
        return
    right = {"justify": "right", "no_wrap": True}
    t = table(f"graphopt bench ({feeds_mod.describe(feeds)}; {threads} thread(s), interleaved)",
              [("model", {"no_wrap": True}), ("p50 ms", right), ("p90 ms", right), ("items/s", right),
               ("× first", right)])
    for r in rows:
        t.add_row(r["model"], f"{r['p50_ms']:.2f}", f"{r['p90_ms']:.2f}", f"{r['items_per_s']:.1f}", f"{r['speedup_vs_first']:.3f}")
    make_console().print(t)
