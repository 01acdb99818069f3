"""Prompt lookup (``method: ngram``): the tokens that followed the last earlier place where the
sequence's final n tokens occurred, longest n first. It costs no model: it pays where outputs
quote their input (summaries, code edits, retrieval answers)."""

from __future__ import annotations

import numpy as np

_FEW = 16  # candidate places up to which the match lengths are read in Python


def propose(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens to follow ``tokens`` (prompt and output so far, int64): for ``n`` from
    ``n_max`` down to ``n_min``, the latest earlier occurrence of the last ``n`` tokens, and what
    came after it; nothing where no suffix recurs.

    One comparison over the sequence finds the earlier places of its last token; the match
    length of each is then read backwards over those places only (a step runs this for every
    decoding sequence, so it is kept to a few array operations whatever the length)."""
    tokens = np.asarray(tokens)
    size = len(tokens)
    if size < 2 or k < 1:
        return []
    ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])  # candidate occurrences' last tokens
    if not len(ends):
        return []
    width = min(n_max, size - 1)
    if len(ends) <= _FEW:  # a Python walk costs less than the array operations' overhead
        tail = tokens[size - width :].tolist()[::-1]  # the last token first
        best, best_end = 0, -1
        for end in ends.tolist():
            run = tokens[max(0, end - width + 1) : end + 1].tolist()[::-1]
            n = 0
            while n < len(run) and run[n] == tail[n]:
                n += 1
            if n >= best:  # ends ascend: the later of equal matches wins
                best, best_end = n, end
        if best < n_min:
            return []
        return tokens[best_end + 1 : best_end + 1 + k].tolist()
    back = np.arange(width)
    at = ends[:, None] - back  # the tokens before each candidate, back to width
    same = (tokens[at.clip(0)] == tokens[size - 1 - back]) & (at >= 0)
    lengths = np.cumprod(same, axis=1).sum(axis=1)  # how far back each candidate matches
    n = int(lengths.max())  # the longest suffix that recurs (at most width)
    if n < n_min:
        return []
    start = int(ends[np.flatnonzero(lengths >= n)[-1]]) + 1  # its latest occurrence
    return tokens[start : start + k].tolist()
