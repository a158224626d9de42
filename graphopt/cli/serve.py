"""``graphopt serve``: the Open Inference Protocol (KServe v2 REST) with dynamic batching."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Threads
from graphopt.runtime.session import Provider as ProviderChoice

EPILOG = """\
Examples:

  graphopt serve repo --port 8000                  # a `graphopt deploy` repository

  graphopt serve minilm.int8.onnx --max-batch 32 --max-delay-ms 5

  curl localhost:8000/v2/models/minilm
"""


def command(
    model: Annotated[Path, typer.Argument(help="ONNX model, or a `graphopt deploy` repository.", show_default=False)],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="Port to listen on.")] = 8000,
    name: Annotated[str | None, typer.Option("--name", help="Model name (default: the repository entry, else the file name up to its first dot: minilm.int8.onnx -> minilm).")] = None,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Most rows in one batch (1: batching off).")] = 32,
    max_delay_ms: Annotated[float, typer.Option("--max-delay-ms", help="Longest wait for a batch to fill.")] = 5.0,
    max_length: Annotated[int | None, typer.Option("--max-length", help="Longest sequence accepted (default: manifest, else 512).")] = None,
    max_body_mb: Annotated[float, typer.Option("--max-body-mb", help="Largest request body.")] = 16.0,
    provider: Annotated[ProviderChoice | None, typer.Option("--provider", help="Execution provider (default: manifest, else cpu).", case_sensitive=False)] = None,
    threads: Threads = 0,
    instances: Annotated[int, typer.Option("--instances", help="ONNX Runtime sessions running batches at once (default: manifest, else 1); on CPU each gets 1 intra-op thread unless --threads.")] = 0,
) -> None:
    """Serve MODEL over HTTP: /v2/health/ready, /v2/models/NAME, /v2/models/NAME/infer (JSON or binary).

    Concurrent requests are batched (up to --max-batch rows, waiting at most --max-delay-ms). A
    remove-padding model batches any lengths together; a padded model batches similar lengths. With
    --instances N, N sessions run batches at the same time (on CPU one core each: on graphopt's packed
    models that scales better than intra-op threads).
    Ctrl-C / SIGTERM stops accepting and finishes in-flight requests first.
    """
    from graphopt.errors import UsageError

    try:
        from graphopt.serve.app import serve
    except ImportError as e:
        raise UsageError(f"graphopt serve needs the serve extra ({e.name} is missing)",
                         hint="pip install 'graphopt[serve]'") from None
    from graphopt.serve import load_runner

    if instances < 0:
        raise UsageError("--instances must be at least 1")
    runner = load_runner(model, name=name, provider=str(provider) if provider else None, threads=threads or None,
                         max_length=max_length, instances=instances or None)
    print(f"serving {runner.name!r} ({runner.sig.padding}) on http://{host}:{port}/v2/models/{runner.name}",
          flush=True)
    serve(runner, host=host, port=port, max_batch=max_batch, max_delay_ms=max_delay_ms,
          max_body=int(max_body_mb * 2**20), log_level="warning")
