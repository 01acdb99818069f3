"""Which proposed tokens a step accepts.

A sequence that carries drafts ``d1..dk`` gets ``k + 1`` rows in the step: the target's logits
after its last token and after each draft. Every row is sampled by the backend's ``sample`` op
exactly as a plain step would sample that position (its step index, penalties and suppression
as at that index: ``model_runner.drafts_ahead``), and a draft is accepted while it equals the
token drawn at its position. The first token that differs is emitted in its place, and when
every draft holds, the last row's token is emitted as well.

This is rejection sampling with a one-hot proposal: the target draws ``d`` with probability
``p(d)`` (accept), and a draw that is not ``d`` follows ``p`` without ``d``, renormalised (the
residual distribution of the standard rule, ``max(0, p - q)`` normalised, for ``q`` one-hot at
``d``). Every proposer fd has is deterministic (a prompt lookup; a draft model's or an MTP
layer's argmax), so no proposal distribution travels to the device and the ``sample`` op is
the verification kernel: a backend's own sampler (cuda's Triton kernel) verifies. The
contract's counter-based noise makes each row's draw a function of its seed, step and logits
alone, so a seeded sequence emits the same tokens with or without speculation, whatever else
is in the batch, at any temperature; greedy rows are the special case.
"""

from __future__ import annotations

import numpy as np


def accepted(sampled: np.ndarray, starts: np.ndarray, drafts: list[list[int]]) -> np.ndarray:
    """Per speculating sequence ``i``, how many of its drafts hold. ``sampled [R]``: the token
    drawn at each row of the step; sequence ``i``'s rows begin at ``starts[i]``, one after its
    last token then one after each of ``drafts[i]``. It then emits its rows' tokens up to and
    including row ``starts[i] + accepted[i]``."""
    n = len(drafts)
    if not n:
        return np.zeros(0, dtype=np.int64)
    lengths = np.fromiter(map(len, drafts), dtype=np.int64, count=n)
    width = int(lengths.max())
    table = np.full((n, width), -1, dtype=np.int64)
    columns = np.arange(width)
    table[columns < lengths[:, None]] = np.fromiter((t for d in drafts for t in d), dtype=np.int64,
                                                    count=int(lengths.sum()))
    rows = np.minimum(np.asarray(starts, dtype=np.int64)[:, None] + columns, len(sampled) - 1)
    holds = np.asarray(sampled)[rows] == table  # the padding (-1) never equals a token
    return np.cumprod(holds, axis=1).sum(axis=1)
