"""``fd bench serve --plot``: TTFT and ITL distributions as a PNG, since runs are compared by eye.

Two histograms side by side (time to first token per request, gap between tokens within a
stream), each with the chosen percentiles marked. Drawn on a bare ``Figure`` (the Agg canvas, no
pyplot state), so it works without a display and from any thread. matplotlib is the ``bench``
extra: ``pip install 'fd-core[bench]'``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fd_core.bench.stats import percentile, percentile_key
from fd_core.errors import ConfigError

INSTALL = "pip install 'fd-core[bench]'"
SIZE_INCHES = (12.0, 4.8)
DPI = 100
MAX_BINS = 60


def require_matplotlib() -> None:
    """Raise ConfigError before a run that could not draw its plot at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(f"--plot needs matplotlib, which is not installed: {INSTALL}") from None


def _panel(ax: Any, values_ms: Sequence[float], percentiles: Sequence[float], name: str, unit: str,
           counted: str) -> None:
    ax.set_title(f"{name} ({len(values_ms)} {counted})")
    ax.set_xlabel(f"{name} ({unit})")
    ax.set_ylabel(counted)
    ax.grid(True, alpha=0.3)
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    from matplotlib.ticker import MaxNLocator

    bins = max(1, min(MAX_BINS, len(set(values_ms))))
    ax.hist(values_ms, bins=bins, color="tab:blue", alpha=0.75)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts
    colors = ("tab:green", "tab:orange", "tab:red", "tab:purple", "tab:brown", "tab:pink")
    for i, q in enumerate(percentiles):
        value = percentile(values_ms, q)
        ax.axvline(value, color=colors[i % len(colors)], linestyle="--", linewidth=1.5,
                   label=f"{percentile_key(q)} {value:.1f} {unit}")
    if percentiles:
        ax.legend(loc="upper right")


def distribution_figure(ttft_ms: Sequence[float], itl_ms: Sequence[float], percentiles: Sequence[float],
                        title: str) -> Any:
    """A matplotlib Figure: TTFT histogram (one value per request) left, ITL (one per token gap) right."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    left, right = fig.subplots(1, 2)
    _panel(left, ttft_ms, percentiles, "TTFT", "ms", "requests")
    _panel(right, itl_ms, percentiles, "ITL", "ms", "token gaps")
    fig.suptitle(title)
    return fig


def save_plot(path: str, ttft_ms: Sequence[float], itl_ms: Sequence[float], percentiles: Sequence[float],
              title: str) -> None:
    distribution_figure(ttft_ms, itl_ms, percentiles, title).savefig(path, format="png")
