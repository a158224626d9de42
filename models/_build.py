"""Shared helpers of the model-building scripts: the cache folder and atomic placement.

The cache is ``$GRAPHOPT_CACHE`` or ``~/.cache/graphopt/models``. Every artefact is built in a
temporary name beside its final one and moved into place with ``os.replace``, so a reader (or a
parallel build) never sees a half-written model.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The models cache folder (created)."""
    p = Path(cache) if cache else Path(os.environ.get("GRAPHOPT_CACHE") or Path.home() / ".cache" / "graphopt" / "models")
    p.mkdir(parents=True, exist_ok=True)
    return p


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the options every build script shares: ``--cache-dir``, ``--force``, ``-v``."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--force", action="store_true", help="rebuild even when cached")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def parse_args(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv`` and set up logging (INFO with ``-v``)."""
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return args


def offline() -> None:
    """No model hub: everything here is local."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def place_file(src: Path, dst: Path) -> Path:
    """Copy ``src`` (and its ``.data`` file, if any) to ``dst`` atomically."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    data = Path(str(src) + ".data")
    if data.exists():
        tmp = dst.parent / f".{dst.name}.data.{os.getpid()}.tmp"
        shutil.copyfile(data, tmp)
        os.replace(tmp, Path(str(dst) + ".data"))
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
    return dst


def place_dir(build, dst: Path) -> Path:
    """Run ``build(tmp_folder)`` and move the folder to ``dst`` (kept if another process won)."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        build(tmp)
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def place_random_model(cls, config, dst: Path, seed: int) -> Path:
    """Save ``cls.from_config(config)`` (eager attention, weights from ``seed``) as an HF folder at ``dst``."""
    import torch
    import transformers

    def write(tmp: Path) -> None:
        transformers.utils.logging.disable_progress_bar()
        torch.manual_seed(seed)
        model = cls.from_config(config, attn_implementation="eager")
        model.config._attn_implementation = None  # let the exporter pick
        model.eval().save_pretrained(tmp)

    return place_dir(write, dst)


def export_cached(src, name: str, *, task: str, exporter: str = "dynamo", attn: str | None = None,
                  cache: str | os.PathLike | None = None, force: bool = False, **kw) -> Path:
    """``graphopt.exporters.export`` into ``cache/name.onnx`` unless it is there already."""
    from graphopt.exporters import export

    out = cache_dir(cache) / f"{name}.onnx"
    if out.exists() and not force:
        return out
    # export() writes through graphopt.io.save: temp file in the target folder, then rename.
    result = export(src, out, task=task, exporter=exporter, attn=attn, **kw)
    logger.info("%s: %s, max_abs %.3g", out.name, result.exporter, result.parity.max_abs)
    return out


def run_main(body) -> int:
    """Run a model script's ``body()``; a GraphoptError becomes one error line (and a hint) on stderr."""
    import sys

    from graphopt.errors import GraphoptError

    try:
        return body() or 0
    except GraphoptError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"hint: {e.hint}", file=sys.stderr)
        return e.exit_code


def fit_linear_head(x, y, classes: int, seed: int = 0, max_iter: int = 200):
    """(weight [classes, F], bias [classes]) of a logistic head on features ``x`` (torch, [N, F]) for labels
    ``y``: standardised features, full-batch L-BFGS, L2 1e-3, the standardisation folded back in."""
    import torch

    mean, std = x.mean(0), x.std(0) + 1e-6
    torch.manual_seed(seed)
    head = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.LBFGS(head.parameters(), lr=0.5, max_iter=max_iter)
    xs = (x - mean) / std

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(xs), y) + 1e-3 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return head.weight / std, head.bias - (head.weight * mean / std).sum(1)
