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

  graphopt serve smollm2.int4.onnx --slots 16      # a decoder: OpenAI /v1/completions, /v1/chat/completions

  curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 20}'
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
    slots: Annotated[int, typer.Option("--slots", help="Decoders: most requests decoding at once (continuous batching).", min=1)] = 8,
    context: Annotated[int | None, typer.Option("--context", help="Decoders: most positions per request, prompt and new tokens (default: the model's maximum, at most 2048).", min=2)] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", help="Decoders: most requests waiting for a slot; more get 429.", min=0)] = 64,
    prefill_tokens: Annotated[int, typer.Option("--prefill-tokens", help="Decoders: most prompt tokens prefilled between two decode steps (at least one request).", min=1)] = 512,
    prefix_cache: Annotated[int, typer.Option("--prefix-cache", help="Decoders: recent prompts whose KV positions are kept for requests that begin with the same tokens (16 or more; 0: none).", min=0)] = 4,
    tokenizer: Annotated[Path | None, typer.Option("--tokenizer", help="Decoders: folder of the tokenizer (default: the model's folder).")] = None,
) -> None:
    """Serve MODEL over HTTP: /v2/health/ready, /v2/models/NAME, /v2/models/NAME/infer (JSON or binary).

    Concurrent requests are batched (up to --max-batch rows, waiting at most --max-delay-ms). A
    remove-padding model batches any lengths together; a padded model batches similar lengths. With
    --instances N, N sessions run batches at the same time (on CPU one core each: on graphopt's packed
    models that scales better than intra-op threads).

    A decoder with past (as for `graphopt generate`, tokenizer beside it) is served for generation instead:
    /v1/completions, /v1/chat/completions, /v1/models (OpenAI-compatible, stream=true as server-sent
    events) and /v2/models/NAME/generate[_stream], with continuous batching over --slots requests.
    Ctrl-C / SIGTERM stops accepting and finishes in-flight requests first.
    """
    from graphopt.errors import UsageError

    try:
        from graphopt.serve.app import serve
    except ImportError as e:
        raise UsageError(f"graphopt serve needs the serve extra ({e.name} is missing)",
                         hint="pip install 'graphopt[serve]'") from None
    from graphopt.serve import load_runner
    from graphopt.serve.generation import is_decoder

    if is_decoder(model):
        from graphopt.serve.genapp import serve_generation
        from graphopt.serve.generation import DecoderService

        service = DecoderService.load(model, name=name, tokenizer=tokenizer, slots=slots, context=context,
                                      max_queue=max_queue, prefill_tokens=prefill_tokens, prefix_cache=prefix_cache,
                                      threads=threads or None)
        print(f"serving {service.name!r} (generation, {service.engine.scheduler.slots} slots, context "
              f"{service.context}) on http://{host}:{port}/v1", flush=True)
        serve_generation(service, host=host, port=port)
        return
    if instances < 0:
        raise UsageError("--instances must be at least 1")
    runner = load_runner(model, name=name, provider=str(provider) if provider else None, threads=threads or None,
                         max_length=max_length, instances=instances or None)
    print(f"serving {runner.name!r} ({runner.sig.padding}) on http://{host}:{port}/v2/models/{runner.name}",
          flush=True)
    serve(runner, host=host, port=port, max_batch=max_batch, max_delay_ms=max_delay_ms,
          max_body=int(max_body_mb * 2**20), log_level="warning")
