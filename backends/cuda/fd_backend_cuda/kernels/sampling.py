"""Sampling: the ``sample`` op in one Triton program per row, with no sort.

A greedy row (temperature 0) takes the argmax of its (biased, penalised, suppressed, masked)
logits ``x``, ties to the lowest id. Any other row follows ``fd_core.testing.spec.sample`` step
for step, each step a blocked loop over the row:

1. ``m = max(x)``; ``z = (x - m) / T`` is recomputed, rounded as the spec rounds it, wherever
   it is needed.
2. Top-k (``0 < k < V``): the k-th largest logit, found exactly by a search over the int32
   image of the float32 bit pattern (``_key``, monotone): each pass counts the tokens above
   ``WAYS`` thresholds at once and narrows the range ``WAYS``-fold (8 passes at most). ``z`` is
   monotone in ``x``, so the k-th largest ``z`` is that logit's ``z``; survivors: ``z >= it``.
3. ``S = sum(exp(z))`` over the survivors; ``p = exp(z) / S``.
4. Top-p (``top_p < 1``): the smallest threshold ``c`` such that the mass of the tokens with
   ``p > c`` is below ``top_p``, by the same search on ``_key(p)`` with masses in place of counts.
   Every token with ``p >= c`` is kept: that is the spec's rule (keep tokens, most likely first,
   while the mass before them is below ``top_p``, ties at the edge kept), and the most likely
   token is always kept.
5. Min-p: ``p >= min_p * max(p)``.
6. ``S2`` = the kept mass; the token is ``argmax((p / S2) / noise)``, ties to the lowest id, with
   the contract's counter-based noise computed in the kernel (``_noise``).
7. The raw numbers: the token's raw logprob and rank and the row's logsumexp (one more pass).

A search stops reading the whole row once at most ``CAP`` tokens lie between its bounds (after
one to three passes, typically): it copies them (id and logit) into a scratch row and finishes
on them, the tokens above its upper bound entering as a constant. Where every token at or
above the lower bound fits (top-k; a narrow nucleus), every token that can still be kept is in
the scratch row, and the later steps read only it. So a greedy row reads the row twice, an
unfiltered one five times, a filtered one about five to eight times.

The thresholds are the spec's exactly; sums are formed in another order, so a row can differ
from the spec only where a top-p / min-p edge or the race's winner is within rounding of a tie.

``PRECISE`` (on a GPU) takes exp, log and log1p from libdevice: Triton's own ``exp`` is an
approximation a few ulps off, which the spec's comparisons would feel. Triton's interpreter has
no libdevice, so there they are NumPy's, log1p computed from ``log`` (Goldberg's formula, a few
ulps).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from fd_core.interfaces.ops import SampleOutput, SamplingBatch
from fd_core.runtimes.torch import ops as torch_ops
from triton.language.extra import libdevice

from fd_backend_cuda.deferred import GatedBitmask
from fd_backend_cuda.kernels._common import check_float, interpreting, next_pow2

# _key(-inf): no float32 other than NaN has a smaller key.
KEY_NEG_INF = tl.constexpr(-2139095041)
# Candidate thresholds per search pass: 16 narrows a 2**31 range in 8 passes.
WAYS = 16
# Tokens per loop step: plain passes (per-lane accumulators), and search passes, which work on
# UNROLL [WAYS, SEARCH_BLOCK] tiles a step. Chosen on an H200 at S=128, V=103424 (with 16 warps;
# 8 were a third slower).
BLOCK = 4096
SEARCH_BLOCK = 512
UNROLL = 4
NUM_WARPS = 16
INTERPRETER_BLOCK = 4096  # the interpreter's cost is per operation: few, large steps
# A search gathers its remaining candidates into a scratch row once at most CAP are left.
CAP = 4096

TWO_POW_M31 = tl.constexpr(2.0**-31)
ONE_MINUS_ULP = tl.constexpr(1.0 - 2.0**-24)  # the largest float32 below 1


@triton.jit
def _lowbias32(x):
    """``fd_core.testing.spec._lowbias32`` on uint32 (multiplications wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _fmix32(x):
    """``fd_core.testing.spec._fmix32`` on uint32 (multiplications wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _row_keys(seed, step):
    """``fd_core.testing.spec.sampling_keys`` of one row, from its int64 seed and step (on the
    device: the host's NumPy version costs ~20 small array operations a step)."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    st = (step & 0xFFFFFFFF).to(tl.uint32)
    key0 = _fmix32(_fmix32(_fmix32(lo ^ 0x243F6A88) ^ hi) ^ st)
    key1 = _fmix32(_fmix32(_fmix32(st ^ 0x85A308D3) ^ lo) ^ hi)
    return key0, key1


@triton.jit
def _noise(ids, key0, key1, PRECISE: tl.constexpr):
    """The contract's Exponential(1) noise of token ``ids`` (``spec.counter_noise``)."""
    h = _lowbias32(_lowbias32(ids.to(tl.uint32) ^ key0) ^ key1)
    f = (h >> 1).to(tl.int32).to(tl.float32)  # rounds to nearest even, as the spec's cast
    v = tl.minimum(tl.maximum(f, 1.0) * TWO_POW_M31, ONE_MINUS_ULP)
    if PRECISE:
        noise = -libdevice.log1p(-v)
    else:
        # -log1p(-v) = log(u) * v / (u - 1) with u = 1 - v rounded (Goldberg), and v where u is 1.
        u = 1.0 - v
        below = tl.where(u == 1.0, -1.0, u - 1.0)  # no 0 / 0 in the branch not taken
        noise = tl.where(u == 1.0, v, tl.log(u) * tl.math.div_rn(v, below))
    return noise


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _key(x):
    """An int32 with the order of the float32 ``x`` (``-0`` and ``+0`` both 0)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(x == 0.0, 0, bits)


@triton.jit
def _pivots(lo, hi, WAYS: tl.constexpr):
    """``WAYS`` ascending thresholds splitting ``[lo, hi)`` evenly, the last clamped to ``hi``
    (int64 scalars in, int64 ``[WAYS]`` out)."""
    step = (hi - lo + WAYS - 1) // WAYS
    return tl.minimum(lo + (tl.arange(0, WAYS) + 1) * step - 1, hi)


@triton.jit
def _narrow(lo, hi, pivots, ok, WAYS: tl.constexpr):
    """The range left after testing ``pivots``: the first pivot where the monotone predicate
    holds (``ok``) becomes ``hi``, the one before it + 1 becomes ``lo``."""
    j = tl.arange(0, WAYS)
    first = tl.min(tl.where(ok, j, WAYS), axis=0)
    at_first = tl.sum(tl.where(j == first, pivots, 0), axis=0)
    before = tl.sum(tl.where(j == first - 1, pivots, 0), axis=0)
    new_hi = tl.where(first < WAYS, at_first, hi)
    # No pivot holds: the predicate holds at hi by convention (the max is always kept).
    new_lo = tl.minimum(tl.where(first > 0, before + 1, lo), new_hi)
    return new_lo, new_hi


@triton.jit
def _lowest_argmax(values, ids):
    """The max of per-lane maxima and the lowest id holding it."""
    best = tl.max(values, axis=0)
    return best, tl.min(tl.where(values == best, ids, 2**31 - 1), axis=0)


# A row's context, passed to the helpers below as one tuple: ``row = (x_row, ids_row, xs_row,
# best, temperature)``: its logits, its scratch row (ids and logits of gathered candidates), its
# max and its temperature. ``cut = (kth, total)``: the top-k survivors' least z key and exp sum.


@triton.jit
def _masked(x, words_row, c, valid, HAS_MASK: tl.constexpr):
    """``x`` at token ids ``c``, -inf where the row's packed bitmask (``words_row``: bit ``c % 32``
    of word ``c // 32``) leaves the token out."""
    if HAS_MASK:
        word = tl.load(words_row + c // 32, mask=valid, other=0)
        x = tl.where(((word >> (c % 32)) & 1) != 0, x, float("-inf"))
    return x


@triton.jit
def _load(row, c, n, COMPACT: tl.constexpr, HAS_MASK: tl.constexpr):
    """Token ids and logits at positions ``c`` of the row's source: the whole row (the tokens
    its bitmask leaves out at -inf), or (``COMPACT``) the candidates gathered in the scratch
    row, which hold only tokens the mask allows."""
    x_row, ids_row, xs_row, _, _, words_row = row
    valid = c < n
    if COMPACT:
        ids = tl.load(ids_row + c, mask=valid, other=0)
        x = tl.load(xs_row + c, mask=valid, other=float("-inf"))
    else:
        ids = c
        x = _masked(tl.load(x_row + c, mask=valid, other=float("-inf")).to(tl.float32), words_row, c, valid,
                    HAS_MASK)
    return ids, x, valid


@triton.jit
def _z(x, row):
    """The spec's ``z = (x - max) / T``, rounded as it rounds."""
    _, _, _, best, temperature, _ = row
    return tl.math.div_rn(x - best, temperature)


@triton.jit
def _unkey(key):
    """The float32 whose ``_key`` is ``key``."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _prob(z, cut, PRECISE: tl.constexpr):
    """``p = exp(z) / S`` for top-k survivors (``_key(z) >= kth``), 0 for the others."""
    kth, total = cut
    return tl.where(_key(z) >= kth, tl.math.div_rn(_exp(z, PRECISE), total), 0.0)


@triton.jit
def _search_value(x, row, cut, BY_MASS: tl.constexpr, PRECISE: tl.constexpr):
    """What a search compares: ``p`` (top-p) or the logit itself (top-k: ``z`` is monotone in
    it, so the k-th largest ``z`` is the k-th largest logit's, and no division is needed)."""
    if BY_MASS:
        v = _prob(_z(x, row), cut, PRECISE)
    else:
        v = x
    return v


@triton.jit
def _above_of(
    row, n, cut, pivots, BY_MASS: tl.constexpr, COMPACT: tl.constexpr, SBLOCK: tl.constexpr,
    UNROLL: tl.constexpr, WAYS: tl.constexpr, PRECISE: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """The count (and, ``BY_MASS``, the mass) of the source's tokens above each pivot.

    Accumulated per lane and reduced once (a reduction across the program every step would
    cost more than the step), in ``[WAYS, SBLOCK]`` tiles so that a token's comparisons stay in
    the thread that loaded it; ``UNROLL`` independent sub-tiles a step keep loads in flight."""
    scols = tl.arange(0, SBLOCK)
    p32 = pivots.to(tl.int32)
    lane_above = tl.zeros([WAYS, SBLOCK], tl.int32)
    lane_mass = tl.zeros([WAYS, SBLOCK], tl.float32)
    for start in range(0, n, SBLOCK * UNROLL):
        for u in tl.static_range(UNROLL):
            _, x, valid = _load(row, start + u * SBLOCK + scols, n, COMPACT, HAS_MASK)
            v = _search_value(x, row, cut, BY_MASS, PRECISE)
            over = (_key(v)[None, :] > p32[:, None]) & valid[None, :]
            lane_above += over.to(tl.int32)
            if BY_MASS:
                lane_mass += tl.where(over, v[None, :], 0.0)
    return tl.sum(lane_above, axis=1), tl.sum(lane_mass, axis=1)


@triton.jit
def _gather(
    row, vocab, cut, lo, hi, everything, BY_MASS: tl.constexpr, CAP: tl.constexpr,
    BLOCK: tl.constexpr, PRECISE: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """Copies the row's tokens (id and logit) whose key is in ``[lo, hi]``, or ``>= lo`` where
    ``everything``, into the scratch row in id order. Returns how many, and the count and mass
    of the tokens above ``hi`` it left out."""
    _, ids_row, xs_row, _, _, _ = row
    cols = tl.arange(0, BLOCK)
    gathered = tl.zeros([], tl.int32)
    lane_count = tl.zeros([BLOCK], tl.int32)
    lane_mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        ids, x, valid = _load(row, start + cols, vocab, False, HAS_MASK)
        v = _search_value(x, row, cut, BY_MASS, PRECISE)
        key = _key(v)
        left = valid & (key > hi) & (everything == 0)
        take = valid & (key >= lo) & ~left
        at = gathered + tl.cumsum(take.to(tl.int32), axis=0) - 1
        take = take & (at < CAP)  # never false: the caller counted at most CAP
        tl.store(ids_row + at, ids, mask=take)
        tl.store(xs_row + at, x, mask=take)
        gathered += tl.sum(take.to(tl.int32), axis=0)
        lane_count += left.to(tl.int32)
        lane_mass += tl.where(left, v, 0.0)
    return gathered, tl.sum(lane_count, axis=0), tl.sum(lane_mass, axis=0)


@triton.jit
def _threshold(
    row, vocab, n, compact, cut, lo, hi, target, BY_MASS: tl.constexpr, CAP: tl.constexpr,
    BLOCK: tl.constexpr, SBLOCK: tl.constexpr, UNROLL: tl.constexpr, WAYS: tl.constexpr,
    PRECISE: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """The smallest key ``c`` in ``[lo, hi]`` (``hi`` qualifies by convention) at which the
    tokens above hold less than ``target``: a count of logit keys (top-k) or, ``BY_MASS``, a
    mass of ``p`` (top-p).

    Once at most ``CAP`` tokens lie in ``[lo, hi]``, they are gathered into the scratch row and
    the rest of the search reads only them (the tokens above ``hi`` enter as a constant). If
    every token ``>= lo`` fits, the scratch row holds every token that can still be kept, and
    the row's later steps read it too. Returns ``(c, n, compact)``: the threshold and the source
    for the next steps (``compact``: the scratch row's first ``n`` entries, else the row)."""
    j = tl.arange(0, WAYS)
    at_least_lo = n  # tokens with a key >= lo
    above_hi = tl.zeros([], tl.int32)  # tokens with a key > hi: none above the max
    partial = tl.zeros([], tl.int32)  # the scratch row lacks the tokens above a gather's hi
    base_count = tl.zeros([], tl.int32)
    base_mass = tl.zeros([], tl.float32)
    while lo < hi:
        within = at_least_lo - above_hi
        if (compact == 0) & (within <= CAP) & (within * 4 <= n):
            everything = (at_least_lo <= CAP).to(tl.int32)
            n, base_count, base_mass = _gather(
                row, vocab, cut, lo, hi, everything, BY_MASS, CAP, BLOCK, PRECISE, HAS_MASK
            )
            compact = tl.full([], 1, tl.int32)
            partial = 1 - everything
        pivots = _pivots(lo, hi, WAYS)
        # The branch is taken outside the loop, so that each loop is straight-line code.
        if compact != 0:
            above, mass = _above_of(
                row, n, cut, pivots, BY_MASS, True, SBLOCK, UNROLL, WAYS, PRECISE, HAS_MASK
            )
        else:
            above, mass = _above_of(
                row, n, cut, pivots, BY_MASS, False, SBLOCK, UNROLL, WAYS, PRECISE, HAS_MASK
            )
        above += base_count
        if BY_MASS:
            ok = (mass + base_mass) < target
        else:
            ok = above < target
        first = tl.min(tl.where(ok, j, WAYS), axis=0)
        # lo moves to just past pivot first - 1 and hi to pivot first.
        at_least_lo = tl.where(
            first > 0, tl.sum(tl.where(j == first - 1, above, 0), axis=0), at_least_lo
        )
        above_hi = tl.where(first < WAYS, tl.sum(tl.where(j == first, above, 0), axis=0), above_hi)
        lo, hi = _narrow(lo, hi, pivots, ok, WAYS)
    if partial != 0:  # kept tokens above the gather's hi are not in the scratch row
        n = vocab
        compact = tl.zeros([], tl.int32)
    return lo.to(tl.int32), n, compact


@triton.jit
def _sweep_of(
    row, n, cut, keep, race, WHAT: tl.constexpr, COMPACT: tl.constexpr, BLOCK: tl.constexpr,
    PRECISE: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """One pass over the source. ``WHAT`` 0: the top-k survivors' exp sum; 1: the kept mass;
    2: the race's winner. ``keep = (edge, floor)``: the top-p key and min-p floor a kept token
    reaches; ``race = (kept, key0, key1)``: the kept mass and the noise keys. Returns
    ``(sum, token)``."""
    kth, _ = cut
    edge, floor = keep
    kept, key0, key1 = race
    cols = tl.arange(0, BLOCK)
    lane = tl.full([BLOCK], -1.0 if WHAT == 2 else 0.0, tl.float32)
    lane_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        ids, x, valid = _load(row, start + cols, n, COMPACT, HAS_MASK)
        z = _z(x, row)
        if WHAT == 0:
            lane += tl.where(valid & (_key(z) >= kth), _exp(z, PRECISE), 0.0)
        else:
            p = _prob(z, cut, PRECISE)
            kept_here = (_key(p) >= edge) & (p >= floor)
            if WHAT == 1:
                lane += tl.where(valid & kept_here, p, 0.0)
            else:
                p = tl.where(kept_here, tl.math.div_rn(p, kept), 0.0)
                r = tl.where(valid, tl.math.div_rn(p, _noise(ids, key0, key1, PRECISE)), -1.0)
                # Within a lane a later token wins only by being larger: ties keep the lower id.
                bigger = r > lane
                lane_id = tl.where(bigger, ids, lane_id)
                lane = tl.where(bigger, r, lane)
    if WHAT == 2:
        value = tl.zeros([], tl.float32)
        _, token = _lowest_argmax(lane, lane_id)
    else:
        value = tl.sum(lane, axis=0)
        token = tl.zeros([], tl.int32)
    return value, token


@triton.jit
def _sweep(
    row, n, compact, cut, keep, race, WHAT: tl.constexpr, BLOCK: tl.constexpr,
    PRECISE: tl.constexpr, HAS_MASK: tl.constexpr,
):  # fmt: skip
    """``_sweep_of`` over the row or the scratch row, the branch taken outside the loop."""
    if compact != 0:
        value, token = _sweep_of(row, n, cut, keep, race, WHAT, True, BLOCK, PRECISE, HAS_MASK)
    else:
        value, token = _sweep_of(row, n, cut, keep, race, WHAT, False, BLOCK, PRECISE, HAS_MASK)
    return value, token


@triton.jit
def _sample_kernel(
    x_ptr,
    x_stride,
    raw_ptr,
    raw_stride,
    vocab,
    params_ptr,
    ids_ptr,
    xs_ptr,
    out_ptr,
    words_ptr,
    words_stride,
    RAW_IS_X: tl.constexpr,
    HAS_MASK: tl.constexpr,
    CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    SBLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
    WAYS: tl.constexpr,
    PRECISE: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + i * x_stride
    raw_row = raw_ptr + i * raw_stride
    words_row = words_ptr + i * words_stride
    cols = tl.arange(0, BLOCK)

    # The max and its lowest id (the greedy answer), kept per lane and reduced once: within a
    # lane, a later block only wins by being larger, so ties keep the lower id.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_id = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        c = start + cols
        x = _masked(tl.load(x_row + c, mask=c < vocab, other=float("-inf")).to(tl.float32), words_row, c, c < vocab,
                    HAS_MASK)
        bigger = x > lane_max
        lane_id = tl.where(bigger, c, lane_id)
        lane_max = tl.where(bigger, x, lane_max)
    best, token = _lowest_argmax(lane_max, lane_id)

    # Per-row parameters, one int64 each: float32 bit patterns, then top_k, seed and step.
    params = params_ptr + i * 6
    temperature = tl.load(params).to(tl.int32).to(tl.float32, bitcast=True)
    if temperature != 0.0:
        top_p = tl.load(params + 1).to(tl.int32).to(tl.float32, bitcast=True)
        min_p = tl.load(params + 2).to(tl.int32).to(tl.float32, bitcast=True)
        top_k = tl.load(params + 3)  # 0 when off
        key0, key1 = _row_keys(tl.load(params + 4), tl.load(params + 5))
        race = (tl.zeros([], tl.float32), key0, key1)
        row = (x_row, ids_ptr + i * CAP, xs_ptr + i * CAP, best, temperature, words_row)
        n = vocab
        compact = tl.zeros([], tl.int32)

        # Top-k: the smallest key with fewer than k logits above it is the k-th largest logit's,
        # whose z is the k-th largest z.
        kth = tl.full([], -(2**31), tl.int32)  # below every key: keeps everything
        if top_k > 0:
            kth_x, n, compact = _threshold(
                row, vocab, n, compact, (kth, 1.0), tl.full([], KEY_NEG_INF, tl.int64),
                _key(best).to(tl.int64), top_k, False, CAP, BLOCK, SBLOCK, UNROLL, WAYS, PRECISE,
                HAS_MASK,
            )  # fmt: skip
            kth = _key(_z(_unkey(kth_x), row))

        # The survivors' exp sum (every z <= 0 and the max's is 0: no shift needed).
        total, _ = _sweep(row, n, compact, (kth, 1.0), (0, 0.0), race, 0, BLOCK, PRECISE, HAS_MASK)
        cut = (kth, total)
        p_max = tl.math.div_rn(1.0, total)  # exp(0) / S

        # Top-p: the smallest p key with less than top_p of mass above it.
        edge = tl.zeros([], tl.int32)  # keeps every p >= 0
        if top_p < 1.0:
            edge, n, compact = _threshold(
                row, vocab, n, compact, cut, tl.zeros([], tl.int64), _key(p_max).to(tl.int64),
                top_p, True, CAP, BLOCK, SBLOCK, UNROLL, WAYS, PRECISE, HAS_MASK,
            )  # fmt: skip
        keep = (edge, min_p * p_max)  # the min-p floor is 0 (keeps all) when it is off

        # The kept mass, then the race over the renormalised distribution.
        kept, _ = _sweep(row, n, compact, cut, keep, race, 1, BLOCK, PRECISE, HAS_MASK)
        race = (kept, race[1], race[2])
        _, token = _sweep(row, n, compact, cut, keep, race, 2, BLOCK, PRECISE, HAS_MASK)

    # The raw log-softmax numbers: the token's logprob, its rank (tokens whose raw logit is at
    # least its own) and the row's logsumexp, in one more pass over the raw logits.
    chosen = tl.load(raw_row + token).to(tl.float32)
    if RAW_IS_X and not HAS_MASK:
        raw_max = best
    else:
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            c = start + cols
            x = tl.load(raw_row + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
            lane_max = tl.maximum(lane_max, x)
        raw_max = tl.max(lane_max, axis=0)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    lane_rank = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        c = start + cols
        x = tl.load(raw_row + c, mask=c < vocab, other=float("-inf")).to(tl.float32)
        lane_sum += _exp(x - raw_max, PRECISE)
        lane_rank += ((x >= chosen) & (c < vocab)).to(tl.int32)
    log_total = _log(tl.sum(lane_sum, axis=0), PRECISE)
    out = out_ptr + i * 4
    tl.store(out, token.to(tl.int64))
    tl.store(out + 1, tl.sum(lane_rank, axis=0).to(tl.int64))
    tl.store(out + 2, ((chosen - raw_max) - log_total).to(tl.int32, bitcast=True).to(tl.int64))
    tl.store(out + 3, (raw_max + log_total).to(tl.int32, bitcast=True).to(tl.int64))


PARAM_STEP = 5  # pack_params' column of each row's step index


def pack_params(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                seeds: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """The kernel's per-row parameters, int64 ``[S, 6]``: the float32 bit patterns of temperature,
    top-p and min-p, then top-k (0 where off), seed and step: one upload for all of them."""
    floats = np.stack([temperature, top_p, min_p], axis=1).astype(np.float32)
    return np.concatenate(
        [
            floats.view(np.int32).astype(np.int64),
            np.asarray(top_k, dtype=np.int64)[:, None],
            np.asarray(seeds, dtype=np.int64)[:, None],
            np.asarray(steps, dtype=np.int64)[:, None],
        ],
        axis=1,
    )


def batch_params(batch: SamplingBatch, vocab: int) -> np.ndarray:
    """``pack_params`` of a batch's rows (top-k at or past the vocabulary is off)."""
    return pack_params(batch.temperature, _top_k(batch.top_k, vocab), batch.top_p, batch.min_p, batch.seeds,
                       batch.steps)


def _top_k(top_k: np.ndarray, vocab: int) -> np.ndarray:
    return np.where((top_k > 0) & (top_k < vocab), top_k, 0)


def _kernel_reads_logits(batch: SamplingBatch, penalised: bool, suppress: bool) -> bool:
    """No logit bias, penalties (``penalised``), suppressed tokens (``suppress``) or top
    logprobs: no torch step around the kernel, which reads the logits as they are."""
    return batch.logit_bias is None and not penalised and not suppress and batch.num_logprobs == 0


def is_plain(batch: SamplingBatch) -> bool:
    """Whether the batch samples with the kernel alone: ``_kernel_reads_logits`` and no bitmask."""
    return batch.allowed_token_bitmask is None and _kernel_reads_logits(
        batch, batch.needs_penalties, batch.needs_suppression)


def launch_draw(
    x: torch.Tensor,
    raw: torch.Tensor,
    params: torch.Tensor,
    out: torch.Tensor,
    ids: torch.Tensor,
    xs: torch.Tensor,
    words: torch.Tensor | None = None,
    cap: int = CAP,
    block: int | None = None,
) -> torch.Tensor:
    """``_sample_kernel`` over the rows of ``x`` into ``out`` (int64 ``[S, 4]``), with the rows'
    ``pack_params`` already on the device and scratch ``ids`` / ``xs`` of ``[S, cap]``: nothing
    allocated, so a CUDA graph can hold it (the decode graphs of ``graphs.py``)."""
    rows, vocab = x.shape
    if block is None:
        block = INTERPRETER_BLOCK if interpreting() else BLOCK
    block = min(block, next_pow2(vocab))
    sblock = block if interpreting() else min(block, SEARCH_BLOCK)
    _sample_kernel[(rows,)](
        x,
        x.stride(0),
        raw,
        raw.stride(0),
        vocab,
        params,
        ids,
        xs,
        out,
        x if words is None else words,  # unread without a mask
        0 if words is None else words.stride(0),
        RAW_IS_X=raw is x,
        HAS_MASK=words is not None,
        CAP=cap,
        BLOCK=block,
        SBLOCK=sblock,
        UNROLL=UNROLL,
        WAYS=WAYS,
        PRECISE=not interpreting(),
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no fused multiply-adds: the spec rounds each operation
    )
    return out


def draw(
    x: torch.Tensor,
    raw: torch.Tensor,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    seeds: np.ndarray,
    steps: np.ndarray,
    cap: int = CAP,
    block: int | None = None,
    words: torch.Tensor | None = None,
) -> torch.Tensor:
    """One launch for a step's rows: float32 logits ``x [S, V]`` after the bias, penalties and
    suppression (``raw`` before them: the same tensor where the batch has none), the grammar's
    packed bitmask ``words`` (int32 ``[S, W]`` on the device, ``upload_bitmask``) applied as the
    kernel reads ``x``,
    per-row host parameters (``top_k`` 0 where off; ``seeds`` and ``steps`` as in SamplingBatch,
    from which the kernel derives each row's noise keys). Returns int64 ``[S, 4]`` on the device:
    token id, rank, and the float32 bit patterns of the token's raw logprob and of the row's raw
    logsumexp. ``cap``: candidates a search gathers into scratch (a power of two; small values
    exercise the gathering in tests)."""
    rows, vocab = x.shape
    out = torch.empty(rows, 4, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    params = torch_ops.upload(pack_params(temperature, top_k, top_p, min_p, seeds, steps), x.device)
    ids = torch.empty(rows, cap, dtype=torch.int32, device=x.device)
    xs = torch.empty(rows, cap, dtype=torch.float32, device=x.device)
    return launch_draw(x, raw, params, out, ids, xs, words, cap, block)


def _float_bits(x: torch.Tensor) -> torch.Tensor:
    """Float32 ``x`` as int64 holding its bit pattern, to travel in one int64 copy."""
    return x.contiguous().view(torch.int32).to(torch.int64)


def _top_ids(raw: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` highest raw logits' ids, best first, ties to the lower id, with no host round
    trip: one ``topk`` over int64 keys (the logit's order in the high half, ``2**32 - 1 - id``
    in the low half), which no two tokens share."""
    bits = raw.view(torch.int32)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    order = torch.where(raw == 0, torch.zeros_like(order), order).to(torch.int64)
    ids = torch.arange(raw.shape[1], dtype=torch.int64, device=raw.device)
    keys = order * 2**32 + (0xFFFFFFFF - ids)
    best = torch.topk(keys, k, dim=-1).values
    return 0xFFFFFFFF - (best & 0xFFFFFFFF)


def sample(
    logits: torch.Tensor, batch: SamplingBatch, cap: int = CAP, block: int | None = None
) -> SampleOutput:
    """The ``sample`` op: ``sample_async``'s result."""
    return sample_async(logits, batch, cap, block).result()


def sample_async(
    logits: torch.Tensor, batch: SamplingBatch, cap: int = CAP, block: int | None = None
) -> DeviceSample:
    """The ``sample_async`` op: logit bias, penalties and suppression (the torch reference's,
    only where the batch has them), then ``_sample_kernel`` (the grammar's bitmask applied as it
    reads the logits; token, raw logprob, rank), and the top logprobs with torch ops when asked;
    one device-to-host copy, not waited for."""
    check_float("sample: logits", logits)
    suppress = batch.needs_suppression  # properties over the rows: once
    # The kernel reads float16/bfloat16 logits as they are (widening is exact): a decode step's
    # cast was a kernel and an allocation on the host's per-step path. The torch-side helpers
    # (bias, penalties, suppression, top logprobs) work on float32.
    penalised = batch.needs_penalties  # a property over three arrays: once
    plain = _kernel_reads_logits(batch, penalised, suppress)
    raw = logits if plain else logits.float()
    if raw.stride(-1) != 1:
        raw = raw.contiguous()
    vocab = raw.shape[1]
    x = torch_ops.bias(raw, batch) if batch.logit_bias is not None else raw
    if penalised:
        x = torch_ops.apply_penalties(x, batch)
    if suppress:
        x = torch_ops.suppress(x, batch)
    mask, words = batch.allowed_token_bitmask, None
    if mask is not None:  # structured output's grammar; a deferred one is queued behind its wait
        words = mask.upload(x.device) if isinstance(mask, GatedBitmask) else torch_ops.upload_bitmask(mask, x.device)
    x = x.contiguous()

    packed = draw(
        x, raw, batch.temperature, _top_k(batch.top_k, vocab), batch.top_p, batch.min_p, batch.seeds, batch.steps,
        cap=cap, block=block, words=words,
    )
    k = batch.num_logprobs
    if k > 0:
        lse = packed[:, 3:].to(torch.int32).view(torch.float32)
        top = _top_ids(raw, k)
        packed = torch.cat([packed, top, _float_bits(torch.gather(raw, -1, top) - lse)], dim=-1)
    return DeviceSample(packed, k)


class DeviceSample:
    """A step's sample on the device (``PendingSample``): int64 ``[S, 4 + 2k]`` rows of token,
    rank, raw-logprob bits, logsumexp bits, then top ids and their logprob bits; the host copy
    lands in pinned memory behind an event, so nothing waits until ``result``."""

    def __init__(self, packed: torch.Tensor, k: int) -> None:
        self.packed, self.k = packed, k
        self._output: SampleOutput | None = None
        self.done: torch.cuda.Event | None = None
        if packed.is_cuda:
            self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self.host.copy_(packed, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = packed

    def feed(self, ids: torch.Tensor, dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return ids.index_copy_(0, dest, self.packed[:, 0].index_select(0, src))

    def result(self) -> SampleOutput:
        # the grammar thread and the engine's thread both read a deferred step: convert once
        if self._output is None:
            self._output = self._convert()
        return self._output

    def _convert(self) -> SampleOutput:
        if self.done is not None:
            self.done.synchronize()
        host, k = self.host.numpy(), self.k

        def floats(a: np.ndarray) -> np.ndarray:
            return a.astype(np.int32).view(np.float32)

        return SampleOutput(
            token_ids=host[:, 0].copy(),
            logprobs=floats(host[:, 2]),
            ranks=host[:, 1].copy(),
            top_ids=host[:, 4 : 4 + k].copy(),
            top_logprobs=floats(host[:, 4 + k : 4 + 2 * k]).reshape(len(host), k),
        )
