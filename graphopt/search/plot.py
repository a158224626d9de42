"""The Pareto plot: speed against held-back quality, one panel per budget metric (matplotlib, the
``graphopt[plot]`` extra, imported only when drawing)."""

from __future__ import annotations

import io as _io
import math
from pathlib import Path

from graphopt.data.metrics import METRICS, parse_budget
from graphopt.errors import UsageError
from graphopt.search.results import SearchResult, pareto_front


def check_plot_support() -> None:
    """The Pareto plot needs matplotlib (the ``graphopt[plot]`` extra): a one-line error before searching."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--search draws the Pareto front with matplotlib, which is not installed",
                         hint="pip install 'graphopt[plot]'") from None


def _panel(ax, result: SearchResult, metric: str, terms) -> None:
    """One budget metric against speed: every measured candidate, that metric's Pareto front, the budget line."""
    # similarity metrics (cosine, top1) crowd under 1: plot their loss 1 - value on a log scale
    loss = METRICS[metric] and metric != "mismatch"

    def y(v: float) -> float:
        return max(1.0 - v, 1e-7) if loss else v

    pts = [t for t in result.trials if t.speedup is not None and metric in t.held and math.isfinite(t.held[metric])]
    for ok, color, label in ((True, "tab:green", "meets the budget"), (False, "tab:red", "misses the budget")):
        sel = [t for t in pts if (t.meets_budget or t.status == "reference") == ok]
        ax.scatter([t.speedup for t in sel], [y(t.held[metric]) for t in sel], c=color, label=label, zorder=3)
    for t in pts:
        ax.annotate(t.name, (t.speedup, y(t.held[metric])), fontsize=7, xytext=(4, 3), textcoords="offset points")
    names = set(pareto_front(pts, metric))
    front = sorted((t for t in pts if t.name in names), key=lambda t: t.speedup)
    if front:
        ax.plot([t.speedup for t in front], [y(t.held[metric]) for t in front], "--", c="gray", label="Pareto front")
    if result.chosen is not None and result.chosen in pts:
        ax.scatter([result.chosen.speedup], [y(result.chosen.held[metric])], s=220, facecolors="none",
                   edgecolors="black", label=f"chosen: {result.chosen.name}", zorder=4)
    for t in terms:
        ax.axhline(y(t.value), c="tab:orange", lw=1, label=f"budget {t}")
    if loss:
        ax.set_yscale("log")
    ax.set_xlabel("speed vs the lossless recipe (x, interleaved in each trial)")
    ax.set_ylabel(f"1 - {metric} (lower is better)" if loss else metric)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot(result: SearchResult) -> bytes:
    """Speed against held-back quality, one panel per budget metric with its Pareto front, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    terms = parse_budget(result.budget).terms
    metrics = list(dict.fromkeys(t.metric for t in terms)) or [result.metric]
    fig, axes = plt.subplots(1, len(metrics), figsize=(6.5 * len(metrics), 4.5), dpi=110, squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        _panel(ax, result, metric, [t for t in terms if t.metric == metric])
    fig.suptitle(f"graphopt --search: {Path(result.input).name} (held-back feeds)", fontsize=9)
    buf = _io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
