"""`graphopt feeds`: a text file -> a folder of tokenized .npz feeds for --calib.

A thin wrapper over ``graphopt.exporters.text_feeds.write_text_feeds``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from graphopt.cli.options import Json

#: below these, the half of the feeds that ``optimize --calib`` holds back to check a lossy pass's budget
#: (``graphopt.data.feeds.split_feeds``) is too small for the check to mean much
MIN_FEEDS = 4
MIN_HELD_BACK_ITEMS = 64


def thin_split_warning(items: int, batch: int) -> str | None:
    """A warning when ``items`` lines in feeds of ``batch`` make too thin a held-back split, else None."""
    from graphopt.data.feeds import split_feeds

    sizes = [min(batch, items - start) for start in range(0, items, batch)]
    calibrate, held = split_feeds(sizes)
    if len(sizes) >= MIN_FEEDS and sum(held) >= MIN_HELD_BACK_ITEMS:
        return None
    lines = max(MIN_FEEDS * batch, 2 * MIN_HELD_BACK_ITEMS)
    if held is calibrate:
        split = f"with fewer than 2 feeds the same {items} items both calibrate and check"
    else:
        split = (f"--calib calibrates on {len(calibrate)} feed(s) ({sum(calibrate)} items) and checks budgets on "
                 f"the {len(held)} held back ({sum(held)} items)")
    return (f"{items} lines make {len(sizes)} feed(s), too few for a meaningful held-back check: {split}; "
            f"use at least {lines} lines at --batch {batch} ({MIN_FEEDS}+ feeds, {MIN_HELD_BACK_ITEMS}+ items held back)")


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
