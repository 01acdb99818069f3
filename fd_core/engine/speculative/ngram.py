"""Prompt lookup (``method: ngram``): the tokens that followed the last earlier place where the
sequence's final n tokens occurred, longest n first. It costs no model: it pays where outputs
quote their input (summaries, code edits, retrieval answers)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens to follow ``tokens`` (prompt and output so far, int64): for ``n`` from
    ``n_max`` down to ``n_min``, the latest earlier occurrence of the last ``n`` tokens, and what
    came after it; nothing where no suffix recurs."""
    tokens = np.asarray(tokens)
    size = len(tokens)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = tokens[size - n :]
        # windows starting before the suffix itself, each with at least one token after it
        windows = sliding_window_view(tokens[: size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
