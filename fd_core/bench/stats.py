"""Percentiles and distribution summaries of the latencies ``fd bench serve`` measures."""

from __future__ import annotations

import math
from collections.abc import Sequence

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def percentile_key(q: float) -> str:
    """``p50``, ``p99.9``: the name a percentile has in tables and result files (vLLM's)."""
    return f"p{q:g}"


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``"50,90,99"`` -> (50.0, 90.0, 99.0), sorted, repeats dropped; ValueError naming the bad item."""
    values = set()
    for item in text.split(","):
        item = item.strip()
        try:
            q = float(item)
        except ValueError:
            raise ValueError(f"{item!r} is not a number") from None
        if not 0 <= q <= 100:
            raise ValueError(f"{item} is outside 0..100")
        values.add(q)
    return tuple(sorted(values))


def distribution_ms(values_s: Sequence[float],
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | None]:
    """Mean, median, standard deviation and the chosen percentiles, in milliseconds."""
    keys = ["mean", "median", "std", *(percentile_key(q) for q in percentiles)]
    if not values_s:
        # JSON has no NaN; None says "no data" (e.g. TPOT when every output had one token).
        return dict.fromkeys(keys)
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    return {"mean": mean, "median": percentile(ms, 50), "std": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),
            **{percentile_key(q): percentile(ms, q) for q in percentiles}}
