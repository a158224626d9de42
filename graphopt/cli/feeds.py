"""`graphopt feeds`: a text file -> a folder of tokenized .npz feeds for --calib.

A thin wrapper over ``graphopt.exporters.text_feeds.write_text_feeds``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Json


def command(
    tokenizer: Annotated[Path, typer.Option("--tokenizer", help="Hugging Face folder holding the tokenizer.")],
    text: Annotated[Path, typer.Option("--text", help="Text file, one item per line.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the .npz feeds into.")],
    batch: Annotated[int, typer.Option("--batch", help="Items per feed.")] = 32,
    max_length: Annotated[int, typer.Option("--max-length", help="Truncate items to this many tokens.")] = 128,
    order: Annotated[str, typer.Option("--order", help="random (seeded), sorted (by length) or file.")] = "random",
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random order.")] = 0,
    json_: Json = False,
) -> None:
    """Tokenize text into padded batches, one .npz feed per batch.

    optimize --calib calibrates lossy passes on the first half of the feeds and checks their budget on the
    other half; a warning says when the text is too small for that check to mean much.
    """
    from rich.markup import escape

    from graphopt.cli.console import make_console
    from graphopt.data.feeds.split import thin_split_warning
    from graphopt.exporters.text_feeds import write_text_feeds

    stats = write_text_feeds(tokenizer, text, output, batch=batch, max_length=max_length, order=order, seed=seed)
    warning = thin_split_warning(stats.items, batch)
    if json_:
        import json

        typer.echo(json.dumps({"path": str(stats.path), "feeds": stats.batches, "items": stats.items, "batch": batch,
                               "order": order, "padding": stats.padding, "slots": stats.slots, "warning": warning},
                              indent=2))
    else:
        typer.echo(
            f"wrote {stats.batches} feeds ({stats.items} items, batch {batch}, {order} order) to {stats.path}; "
            f"padding {100 * stats.padding:.1f}% of {stats.slots} positions"
        )
    if warning:  # on stderr, with --json too
        make_console(stderr=True).print(f"[bold yellow]warning:[/] {escape(warning)}")
