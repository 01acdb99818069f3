"""Paged attention over a mixed batch of prefill chunks and decodes.

Cache layout per layer: ``(key, value)``, each ``[num_blocks * block_size, Hk, D]``; slot ``s`` is
block ``s // block_size``, offset ``s % block_size``. Sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; its first ``context_lens[i]`` tokens are in the
cache already, new token ``j`` sits at position ``context_lens[i] + j`` and sees positions
``0..context_lens[i] + j``; the cache position ``p`` of sequence ``i`` is slot
``block_tables[i, p // block_size] * block_size + p % block_size``.

Kernels, in launch order (all on q's stream):

1. ``_kv_write_kernel``, grid ``(N, cdiv(Hk, BLOCK_H))``: copies k[n], v[n] into slot
   ``slot_mapping[n]`` of both caches, cast to the cache's dtype or quantized to its format (a
   negative slot is skipped, as padding tokens are in vLLM). It must finish before (2) reads the cache: later programs of (2)
   read new tokens that other programs' rows wrote, so it is not fused. For the contract's
   ``rotary_attention`` its grid also has query-head programs (``ROTARY``): it rotates q into a
   new tensor and k on its way to the cache, and the ``rotary`` op's launch is saved.

2. ``_attention_kernel``, grid ``(items, Hk, num_splits)`` (item-major: ``(Hk, items, num_splits)``,
   see ``_item_major``). A *work item* is (sequence, first
   new token of a query block); the host builds the item list once per step. A program takes
   one item and one kv head, and owns a ``[BLOCK_M, D]`` tile of query rows: ``BLOCK_Q =
   BLOCK_M // G`` consecutive tokens times the ``G = Hq // Hk`` query heads that share the kv
   head (row ``r`` is token ``r // G``, head ``kvh * G + r % G``), so every K/V tile read from the
   cache serves the whole GQA group. It loops over the keys the tile can see in tiles of
   ``BLOCK_N`` positions (each position's slot gathered through ``block_tables``, so ``BLOCK_N``
   is independent of ``block_size``), with ``tl.dot`` for ``QK^T`` and ``PV``, a float32 online
   softmax in base 2 (scale folded with log2 e), and the causal mask ``pos <= context + token``.
   The loop stops at the tile's last visible position, so a prefill block skips the keys after
   it and a decode reads exactly its ``seq_len`` keys. In prefill launches with long key ranges
   (``SPLIT_MASK_KEYS``) the whole tiles that every row of the program sees (below its first
   token) run in a loop of their own without the causal and bounds masks (``_attend_tile``'s
   ``MASKED``).

   Items come in two classes, one launch each (either may be absent):
     * short queries (``query_len <= BLOCK_Q`` of the small tile: decodes, speculative steps):
       ``BLOCK_M = max(16, next_pow2(G))`` (16 is ``tl.dot``'s minimum), one item per sequence;
     * longer prefill chunks: ``BLOCK_M = 128`` (64 with float32 operands),
       ``cdiv(query_len, BLOCK_Q)`` items per sequence.
   ``BLOCK_N`` is 64 (32 for wide heads in the short launch and for float32); see ``_tiles``.
   Items are sorted by descending key count, so each kv head's longest programs start first.

3. Split-K (flash-decoding): when a launch has fewer programs than the GPU has SMs and long
   keys, ``num_splits > 1`` cuts each program's key range into ``num_splits`` BLOCK_N-aligned
   segments, one per program along grid axis 2. Each writes its unnormalised ``(m, l, acc)``
   to a float32 scratch and counts itself in on an int32 counter of its (item, kv head); the
   last to arrive merges them with the log-sum-exp rule, writes the output rows and resets the
   counter (``_merge_splits``), so split-K costs no second launch.

A quantized cache (per block, a plane of int8 or uint8 values and a plane of float16 scales,
fd_core.quantization.kv_cache) is read as values converted to q's dtype (exact for int8 and
e4m3 in 16-bit floats), with the row scales applied to the scores (K) and to the probabilities
before ``PV`` (V), so the dots stay on 16-bit tensor cores.

Host metadata is uploaded once per step into ``meta.device`` (int32, int64 slot mapping); the
per-(Hk, G, D) launch plans are cached there too, so the per-layer host cost is the launches.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl
from fd_core.quantization.kv_cache import KV_QUANTIZED, STORAGE_FORMAT
from fd_core.runtimes.torch import ops as torch_ops

from fd_backend_cuda.kernels._common import (check_float, interpreting, next_pow2, pdl, pdl_start, resident_programs,
                                             sm_count)
from fd_backend_cuda.kernels.rotary import check_table, rotate_heads, rotated

LOG2E = 1.4426950408889634

# Prefill launches whose longest item sees at least this many keys run the tiles below the
# diagonal unmasked (SPLIT_MASK). H100, bf16: 6-11% faster at 4,096-token prompts and 2,048-token
# chunks over 6,144 cached tokens, 6-12% slower at 256-token prompts, where a kernel with two
# loops loses more than the masks cost (an A/B of the two kernels, docs/PERFORMANCE.md).
SPLIT_MASK_KEYS = 2048

# A prefill launch starts its programs item by item (every kv head of the longest items first)
# instead of kv head by kv head only where a simulation of the SMs' queue says that ends the
# launch at least this much sooner: item-major spreads the programs in flight over more kv
# heads' keys, which L2 then holds less of. H200, bf16, 32 / 8 heads: one 4,096-token prompt
# 488 -> 409 us item-major; eight 1,024-token prompts 293 -> 310 us (this rule keeps them as they were).
ITEM_MAJOR_GAIN = 0.95
# A program's cost in the simulation: its keys plus about one tile's worth of start and finish.
PROGRAM_KEYS = 64

# Split-K: no segment shorter than this many keys, at most this many segments.
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 32


# --- kernels -----------------------------------------------------------------------------------


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    pos_ptr,
    cs_ptr,
    q_ptr,
    qo_ptr,
    num_q_heads,
    num_kv_heads,
    head_dim,
    rot,
    cs_stride,
    q_sn,
    q_sh,
    qo_sn,
    qo_sh,
    k_sn,
    k_sh,
    v_sn,
    v_sh,
    kc_ss,
    kc_sh,
    vc_ss,
    vc_sh,
    ROTARY: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_TOP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token ``n``'s k and v rows into their slot. With ``ROTARY`` (1 neox, 2 interleaved: the
    contract's ``rotary_attention``) the programs ``(n, b)`` with ``b`` below the query blocks
    write the token's rotated query heads to ``qo`` instead, and k is rotated on its way."""
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    q_blocks = 0
    cs_row = cs_ptr
    if ROTARY:
        q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
        cs_row = cs_ptr + tl.load(pos_ptr + tok).to(tl.int64) * cs_stride
    if hb < q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        rotate_heads(q_ptr, qo_ptr, tok, heads, num_q_heads, q_sn, q_sh, qo_sn, qo_sh, d, head_dim, cs_row,
                     rot, ROTARY == 1, False)
    else:
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        mask = (heads < num_kv_heads)[:, None] & (d < head_dim)[None, :] & (slot >= 0)
        if ROTARY:
            kx = rotated(k_ptr, tok * k_sn + heads * k_sh, d, mask, cs_row, rot, ROTARY == 1)
            # rounded to k's dtype first, as the rotary op's output is before the cache gets it
            kx = kx.to(k_ptr.dtype.element_ty).to(tl.float32)
        else:
            kx = tl.load(k_ptr + tok * k_sn + heads[:, None] * k_sh + d[None, :], mask=mask, other=0.0)
            kx = kx.to(tl.float32)
        _store_rows(kc_ptr, slot, heads, kc_ss, kc_sh, kx, d, mask, num_kv_heads, head_dim,
                    KV_BLOCK_SIZE, KV_QUANT, KV_TOP)
        vx = tl.load(v_ptr + tok * v_sn + heads[:, None] * v_sh + d[None, :], mask=mask, other=0.0)
        _store_rows(vc_ptr, slot, heads, vc_ss, vc_sh, vx.to(tl.float32), d, mask, num_kv_heads, head_dim,
                    KV_BLOCK_SIZE, KV_QUANT, KV_TOP)


# A quantized cache (fd_core.quantization.kv_cache): each block of KV_BLOCK_SIZE slots is a plane
# of [KV_BLOCK_SIZE, Hk, D] int8 values (KV_QUANT 1) or float8 e4m3 bit patterns in uint8
# (KV_QUANT 2), then a plane of [KV_BLOCK_SIZE, Hk] float16 scales; a scale maps its row's largest
# magnitude to 127 or 448. Bytes equal the specification's: round-to-nearest divisions and
# ties-to-even rounding, as NumPy does.
KV_FORMATS = {torch.int8: 1, torch.uint8: 2}  # the cache's storage dtype -> KV_QUANT
# the cache's storage dtype -> the largest value a row maps to (127, 448)
KV_TOPS = {getattr(torch, name): KV_QUANTIZED[fmt] for name, fmt in STORAGE_FORMAT.items()}
_RINT = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |x| < 2**22 to even


@triton.jit
def _store_rows(cache_ptr, slot, heads, stride_s, stride_h, x, d, mask, num_kv_heads, head_dim,
                KV_BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr, KV_TOP: tl.constexpr):
    """Store ``x`` ``[H, D]`` float32 as the rows of ``heads`` at cache ``slot``."""
    if KV_QUANT == 0:
        rows = cache_ptr + slot * stride_s + heads * stride_h
        tl.store(rows[:, None] + d[None, :], x.to(rows.dtype.element_ty), mask=mask)
    else:
        safe_slot = tl.maximum(slot, 0)  # a negative slot (padding) is masked off
        block_ptr = cache_ptr + (safe_slot // KV_BLOCK_SIZE) * (KV_BLOCK_SIZE * stride_s)
        row = (safe_slot % KV_BLOCK_SIZE) * num_kv_heads + heads  # (offset, head) inside the block
        rows = block_ptr + row * head_dim
        scale_ptr = (block_ptr + KV_BLOCK_SIZE * num_kv_heads * head_dim).to(tl.pointer_type(tl.float16)) + row
        top = KV_TOP
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), top).to(tl.float16)
        safe = tl.where(scale == 0, 1.0, scale.to(tl.float32))
        y = tl.clamp(tl.math.div_rn(x, safe[:, None]), -top, top)
        if KV_QUANT == 1:
            values = ((y + _RINT) - _RINT).to(tl.int8)
        else:
            values = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(rows[:, None] + d[None, :], values.to(rows.dtype.element_ty, bitcast=True), mask=mask)
        row_ok = tl.max(mask.to(tl.int32), axis=1) > 0
        tl.store(scale_ptr, scale, mask=row_ok)


@triton.jit
def _cache_values(x, dtype: tl.constexpr, KV_QUANT: tl.constexpr):
    """A tile of cache values as ``dtype`` (exact: int8 and e4m3 values fit 16-bit floats)."""
    if KV_QUANT == 2:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(dtype)


@triton.jit
def _cache_scales(block_ptr, row, ok, num_kv_heads, HEAD_DIM: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr):
    """The float16 scales (as float32) of quantized ``row``s (offset * Hk + head) in their blocks."""
    ptr = (block_ptr + KV_BLOCK_SIZE * num_kv_heads * HEAD_DIM).to(tl.pointer_type(tl.float16)) + row
    return tl.load(ptr, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _tile_blocks(bt_row, start, hi, BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr):
    """The cache blocks of keys ``start:start + BLOCK_N`` (0 past ``hi``; ``MASKED`` False: none
    of them is)."""
    pos = start + tl.arange(0, BLOCK_N)
    if MASKED:
        return tl.load(bt_row + pos // KV_BLOCK_SIZE, mask=pos < hi, other=0).to(tl.int64)
    return tl.load(bt_row + pos // KV_BLOCK_SIZE).to(tl.int64)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, hi, qpos, d, d_ok, block, kc_ptr, vc_ptr, kc_head, vc_head, kvh,
                 num_kv_heads, kc_ss, vc_ss, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 KV_BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                 KV_QUANT: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """One online-softmax step over the keys ``start:start + BLOCK_N`` in cache blocks ``block``
    (``_tile_blocks``); ``MASKED``: some of them lie past ``hi`` or past a row's position (else
    every row sees all of them)."""
    pos = start + tl.arange(0, BLOCK_N)
    k_ok = pos < hi
    if KV_QUANT:
        # the block's value plane, then its scale plane; value rows at multiples of HEAD_DIM
        row = (pos % KV_BLOCK_SIZE) * num_kv_heads + kvh
        k_block = kc_ptr + block * (KV_BLOCK_SIZE * kc_ss)
        v_block = vc_ptr + block * (KV_BLOCK_SIZE * vc_ss)
        k_rows = k_block + row * HEAD_DIM
        v_rows = v_block + row * HEAD_DIM
    else:
        slot = block * KV_BLOCK_SIZE + pos % KV_BLOCK_SIZE
        k_rows = kc_head + slot * kc_ss
        v_rows = vc_head + slot * vc_ss
    # K^T tile [BLOCK_D, BLOCK_N], V tile [BLOCK_N, BLOCK_D]
    kt_ptrs = k_rows[None, :] + d[:, None]
    if MASKED:
        kt = tl.load(kt_ptrs, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
    elif EVEN_D:
        kt = tl.load(kt_ptrs)
    else:
        kt = tl.load(kt_ptrs, mask=d_ok[:, None], other=0.0)
    if KV_QUANT:  # the values in q's dtype, the row scales on the scores
        kt = _cache_values(kt, q.dtype, KV_QUANT)
        k_scale = _cache_scales(k_block, row, k_ok, num_kv_heads, HEAD_DIM, KV_BLOCK_SIZE) * qk_scale
        s = tl.dot(q, kt, input_precision=PRECISION) * k_scale[None, :]
    else:
        if DOT_F32:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if MASKED:
        visible = (pos[None, :] <= qpos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # every score is finite, so is the new maximum
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_ptrs = v_rows[:, None] + d[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    if KV_QUANT:  # the row scales on the probabilities
        v = _cache_values(v, q.dtype, KV_QUANT)
        pv = p * _cache_scales(v_block, row, k_ok, num_kv_heads, HEAD_DIM, KV_BLOCK_SIZE)[None, :]
    else:
        if DOT_F32:
            v = v.to(tl.float32)
        pv = p
    acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


# The counts that change from step to step are not specialised on (Triton would compile a
# variant for each new divisibility by 16, in the middle of serving).
@triton.jit(do_not_specialize=["num_items", "item_major", "bt_stride"])
def _attention_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    count_ptr,
    item_seq_ptr,
    item_tok_ptr,
    qsl_ptr,
    seq_lens_ptr,
    ctx_lens_ptr,
    bt_ptr,
    qk_scale,
    num_items,
    num_kv_heads,
    item_major,
    q_sn,
    q_sh,
    o_sn,
    o_sh,
    kc_ss,
    kc_sh,
    vc_ss,
    vc_sh,
    bt_stride,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    EVEN_D: tl.constexpr,
    SPLIT_MASK: tl.constexpr,
    TABLES_AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    if item_major:  # every kv head of an item side by side in launch order (_item_major)
        item = tl.program_id(1)
        kvh = tl.program_id(0)
    else:
        item = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    BLOCK_Q: tl.constexpr = BLOCK_M // G

    # The step's metadata is read before the wait: it is uploaded, or written by the step's
    # first kernel (advance.py), before any layer's kernels, and a kernel under programmatic
    # launch starts only once the one two places ahead has finished (every kernel waits before
    # it lets the next one start); only the kernel just ahead (the K/V write) may still run.
    seq = tl.load(item_seq_ptr + item)
    tok0 = tl.load(item_tok_ptr + item)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = tl.load(ctx_lens_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // G
    head = kvh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (tok < q_len)
    qpos = ctx + tok
    d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        d_ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        d_ok = d < HEAD_DIM

    row_off = (q_start + tok).to(tl.int64)
    # Keys this tile can see: up to its last token's position (inclusive).
    kv_end = tl.minimum(ctx + tl.minimum(tok0 + BLOCK_Q, q_len), seq_len)
    if NUM_SPLITS == 1:
        lo = 0
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(kv_end, lo + per_split)
    bt_row = bt_ptr + seq.to(tl.int64) * bt_stride
    if TABLES_AHEAD:
        # block tables are metadata too: each tile's block numbers are asked for a tile ahead
        # (the first before the wait), so a tile's chain of loads starts at its K and V
        blocks = _tile_blocks(bt_row, lo, hi, BLOCK_N, KV_BLOCK_SIZE, True)
    pdl_start(PDL)
    q = tl.load(
        q_ptr + row_off[:, None] * q_sn + head[:, None] * q_sh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kc_head = kc_ptr + kvh.to(tl.int64) * kc_sh
    vc_head = vc_ptr + kvh.to(tl.int64) * vc_sh
    mid = lo
    if SPLIT_MASK:  # the second loop only where it pays (SPLIT_MASK_KEYS)
        # Every row sees the keys up to the tile's first token, so whole BLOCK_N tiles below it
        # need no causal or bounds mask; only the tiles from there to ``hi`` (the diagonal, the
        # ragged end) pay for masking.
        visible_to_all = tl.minimum(ctx + tok0 + 1, hi)
        mid = lo + tl.maximum(visible_to_all - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, mid, BLOCK_N):
            if TABLES_AHEAD:
                here = blocks
                blocks = _tile_blocks(bt_row, start + BLOCK_N, hi, BLOCK_N, KV_BLOCK_SIZE, True)
            else:
                here = _tile_blocks(bt_row, start, hi, BLOCK_N, KV_BLOCK_SIZE, False)
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, qpos, d, d_ok, here, kc_ptr, vc_ptr,
                                         kc_head, vc_head, kvh, num_kv_heads, kc_ss, vc_ss, qk_scale, HEAD_DIM,
                                         BLOCK_N, KV_BLOCK_SIZE, DOT_F32, PRECISION, KV_QUANT, False, EVEN_D)
    for start in range(mid, hi, BLOCK_N):
        if TABLES_AHEAD:
            here = blocks
            blocks = _tile_blocks(bt_row, start + BLOCK_N, hi, BLOCK_N, KV_BLOCK_SIZE, True)
        else:
            here = _tile_blocks(bt_row, start, hi, BLOCK_N, KV_BLOCK_SIZE, True)
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, qpos, d, d_ok, here, kc_ptr, vc_ptr, kc_head,
                                     vc_head, kvh, num_kv_heads, kc_ss, vc_ss, qk_scale, HEAD_DIM, BLOCK_N,
                                     KV_BLOCK_SIZE, DOT_F32, PRECISION, KV_QUANT, True, EVEN_D)

    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        tl.store(
            out_ptr + row_off[:, None] * o_sn + head[:, None] * o_sh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        pair = item * num_kv_heads + kvh
        idx = (split * num_items * num_kv_heads + pair).to(tl.int64) * BLOCK_M + r
        tl.store(part_m_ptr + idx, m_i)
        tl.store(part_l_ptr + idx, l_i)
        tl.store(part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], acc)
        # The last of the (item, kv head)'s splits to get here merges them, instead of a
        # combine kernel after this one: one launch less a layer wherever decodes split (batch
        # 1: a graph node and ~2 us a layer). The barrier makes every thread's partial stores
        # precede the counter's release; the merge reads the partials from L2 (.cg), never
        # from an L1 line an earlier step left; it resets the counter for the next launch.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, pair, num_items * num_kv_heads,
                          row_off, head, row_ok, d, d_ok, o_sn, o_sh, BLOCK_D, BLOCK_M, NUM_SPLITS)
            tl.atomic_xchg(count_ptr + pair, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, pair, pairs, row_off, head, row_ok, d, d_ok,
                  o_sn, o_sh, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Merge the splits' ``(m, l, acc)`` of one (item, kv head) by the log-sum-exp rule and
    write its output rows."""
    r = tl.arange(0, BLOCK_M)
    base = pair.to(tl.int64) * BLOCK_M + r
    split_stride = pairs.to(tl.int64) * BLOCK_M
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_m_ptr + s * split_stride + base, cache_modifier=".cg"))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        idx = s * split_stride + base
        w = tl.exp2(tl.load(part_m_ptr + idx, cache_modifier=".cg") - m_safe)
        l_sum += w * tl.load(part_l_ptr + idx, cache_modifier=".cg")
        acc += w[:, None] * tl.load(part_acc_ptr + idx[:, None] * BLOCK_D + d[None, :], cache_modifier=".cg")
    l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
    tl.store(
        out_ptr + row_off[:, None] * o_sn + head[:, None] * o_sh + d[None, :],
        (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# --- host side ---------------------------------------------------------------------------------


@dataclass
class StepTensors:
    """Device copies of one step's metadata (int32; the slot mapping int64)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class Launch:
    """One attention launch: its work items and tile shape."""

    item_seq: torch.Tensor  # int32 [items]
    item_tok: torch.Tensor  # int32 [items], first new token of the item's query block
    num_items: int
    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    split_mask: bool = False  # the unmasked loop below the diagonal (SPLIT_MASK_KEYS)
    tables_ahead: bool = False  # block-table entries a tile ahead (not in the prefill launch: see _tiles)
    item_major: bool = False  # programs in launch order item by item, not kv head by kv head
    resident_key: tuple | None = None  # a prefill tile whose residency its launch is to record (_RESIDENT)
    # split-K's partial (m, l, acc) and arrival counts, made by the first call
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None)


def _upload(array: np.ndarray, dtype: np.dtype, device: torch.device) -> torch.Tensor:
    return torch_ops.upload(np.asarray(array, dtype=dtype), device)


def step_tensors(meta, device: torch.device) -> StepTensors:
    """The step's metadata on ``device``, uploaded on first use and kept in ``meta.device``."""
    key = f"cuda.step@{device}"
    found = meta.device.get(key)
    if found is None:
        block_tables = np.asarray(meta.block_tables)
        if block_tables.ndim != 2 or block_tables.shape[1] == 0:
            block_tables = np.zeros((max(meta.num_seqs, 1), 1), dtype=np.int64)
        found = meta.device[key] = StepTensors(
            query_start_loc=_upload(meta.query_start_loc, np.int32, device),
            seq_lens=_upload(meta.seq_lens, np.int32, device),
            context_lens=_upload(meta.context_lens, np.int32, device),
            block_tables=_upload(block_tables, np.int32, device),
            slot_mapping=_upload(meta.slot_mapping, np.int64, device),
        )
    return found


def static_step_tensors(meta, device: torch.device, max_blocks: int) -> tuple[StepTensors, torch.Tensor]:
    """Device metadata for the steps of a captured graph (the same number of new tokens per
    sequence, ``meta.query_start_loc``'s: one for decodes): fixed buffers, placed in
    ``meta.device`` so that the kernels captured with ``meta`` read them, and rewritten in place
    before each replay. ``seq_lens``, ``context_lens`` and the slot mapping (int32 here) are one
    buffer, so a replay updates them in one copy; the block tables are ``[num_seqs,
    max_blocks]``, of which a replay writes only the columns in use. Returns the tensors and
    that one int32 buffer."""
    n, tokens = meta.num_seqs, int(meta.query_start_loc[-1])
    packed = torch.zeros(2 * n + tokens, dtype=torch.int32, device=device)
    found = meta.device[f"cuda.step@{device}"] = StepTensors(
        query_start_loc=torch.from_numpy(np.asarray(meta.query_start_loc, dtype=np.int32)).to(device),
        seq_lens=packed[:n],
        context_lens=packed[n : 2 * n],
        block_tables=torch.zeros((n, max_blocks), dtype=torch.int32, device=device),
        slot_mapping=packed[2 * n :],
    )
    return found, packed


def _choose_splits(programs: int, max_keys: int, num_sms: int) -> int:
    if programs >= num_sms or max_keys < 2 * MIN_SPLIT_KEYS:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    splits = max(1, min(want, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))
    # a power of two: NUM_SPLITS is compiled in, and few values mean few compilations
    return 1 << (splits.bit_length() - 1)


def _makespan(costs: np.ndarray, slots: int) -> float:
    """When the last of ``costs`` ends if each starts, in order, on the first of ``slots`` free."""
    ends = [0.0] * min(slots, len(costs))
    replace = heapq.heapreplace  # one sift, not a pop and a push: ~35% less of _item_major's host time
    for cost in costs.tolist():
        replace(ends, ends[0] + cost)
    return max(ends)


def _item_major(keys: np.ndarray, num_kv_heads: int, slots: int) -> bool:
    """Whether a prefill launch's programs (``keys``: its items' key counts, longest first)
    should start item by item. Kv head by kv head, the last kv head's longest items start late
    and run alone at the end: one 4,096-token prompt of 8 kv heads on 132 SMs is ~7 waves of
    items 32 to 4,096 keys long. Launches of at most one wave, or many (where the tail is short
    beside the whole and L2 locality matters more), keep the kv-head-major order."""
    programs = len(keys) * num_kv_heads
    if num_kv_heads == 1 or programs <= slots or programs > 8 * slots:
        return False
    cost = keys.astype(np.float64) + PROGRAM_KEYS
    return _makespan(np.repeat(cost, num_kv_heads), slots) < ITEM_MAJOR_GAIN * _makespan(np.tile(cost, num_kv_heads),
                                                                                          slots)


# Programs an SM held of each prefill tile shape, read from the kernel compiled for its first
# launch (``resident_programs``; the start-up warm-up makes it; later variants of the shape, other
# dtypes or masks, are taken to hold as many). Until then the planner assumes DEFAULT_RESIDENT,
# what the 128 x 64 tiles of head_dim 64 and 128 held on an H200.
_RESIDENT: dict[tuple, int] = {}
DEFAULT_RESIDENT = 2


def _tile_key(device: torch.device, tile: dict, head_dim: int) -> tuple:
    return (str(device), tile["block_m"], tile["block_n"], tile["num_warps"], tile["num_stages"], head_dim)


def _tiles(group: int, head_dim: int, wide: bool) -> tuple[dict, dict]:
    """Tile shapes of the short-query and the prefill launch; ``wide``: 4-byte dot operands.

    H100/H200 sweeps (backends/cuda/benchmarks/sweep_attention.py), bf16, causal prefill of 4096:
    D=128: 128x64 with 4 warps beat 8 warps by 7-18% (~260-300 TFLOP/s); D=256: 128x64, 8 warps,
    3 stages 311 TFLOP/s vs 130 for 64x32; D=64: 128x64 or 64x64, 4 warps, ~210. Short queries
    (decodes), H200, kernel time in a CUDA graph, D=128, 1,088 keys a sequence: 128 keys a tile
    in 2 stages against 64 in 3 took 128 sequences of 2 KV heads (ERNIE-4.5-0.3B) 61.1 -> 44.7
    us, 32 of them 18.1 -> 16.8 us, one of 1,152 keys 11.5 -> 9.6 us, 128 of 8 KV heads (Llama-3-8B)
    148.3 -> 146.4 us: the fewer programs a launch has, the more each one's bytes in flight
    matter. Float32 operands take smaller, shallower tiles to stay inside shared memory
    (untimed: float32 is for tests). Short queries read a tile's block-table entries a tile
    ahead (Llama-3-8B bf16, batch 1: 4.063 -> 4.041 ms a token on an H200); the prefill launch
    does not: at D=256 its software pipeline then asks for 256 KB of shared memory.
    """
    block_d = max(16, next_pow2(head_dim))
    small_m = max(16, next_pow2(group))
    if wide:
        block_n = 32 if block_d > 64 else 64
        small = {
            "block_m": small_m,
            "block_n": block_n,
            "num_warps": 4,
            "num_stages": 2,
            "tables_ahead": True,
        }
        big_m = max(64, next_pow2(group))
        big = {"block_m": big_m, "block_n": block_n, "num_warps": 4, "num_stages": 2}
        return small, big
    small = {
        "block_m": small_m,
        "block_n": 128 if block_d <= 128 else 32,
        "num_warps": 4,
        "num_stages": 2,
        "tables_ahead": True,
    }
    big = {
        "block_m": max(128, next_pow2(group)),
        "block_n": 64,
        "num_warps": 4 if block_d <= 128 else 8,
        "num_stages": 3,
    }
    return small, big


def _items(qlens: np.ndarray, ctx: np.ndarray, seq_lens: np.ndarray, seqs: np.ndarray,
           block_q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The work items of ``seqs`` (their query blocks of ``block_q`` tokens): each item's
    sequence, first token and key count, the longest key range first."""
    blocks = (qlens[seqs] + block_q - 1) // block_q
    item_seq = np.repeat(seqs, blocks)
    first = np.repeat(np.cumsum(blocks) - blocks, blocks)
    item_tok = (np.arange(len(item_seq)) - first) * block_q
    keys = np.minimum(ctx[item_seq] + np.minimum(item_tok + block_q, qlens[item_seq]), seq_lens[item_seq])
    order = np.argsort(-keys, kind="stable")
    return item_seq[order], item_tok[order], keys[order]


def _classes(qlens: np.ndarray, small_q: int) -> tuple[np.ndarray, np.ndarray]:
    """The sequences of the short-query launch and of the prefill launch."""
    return np.flatnonzero((qlens >= 1) & (qlens <= small_q)), np.flatnonzero(qlens > small_q)


def plan_launches(
    meta,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    device: torch.device,
    num_splits: int | None = None,
    wide: bool = False,
) -> list[Launch]:
    """The launches of one step for this (Hk, G, D), built once and kept in ``meta.device``
    (a captured mixed step's: ``MixedPlan``'s fixed launches).

    ``num_splits`` forces the split-K factor of every launch (tests); None chooses it.
    ``wide``: the dot operands are float32 (smaller tiles).
    """
    key = f"cuda.attention/{num_kv_heads}x{group}x{head_dim}/{num_splits}/{int(wide)}@{device}"
    found = meta.device.get(key)
    if found is not None:
        return found
    small, big = _tiles(group, head_dim, wide)
    num_sms = sm_count(device)  # 1 in the interpreter: split only when asked
    static = meta.device.get(f"cuda.mixed@{device}")
    if static is not None:
        found = meta.device[key] = static.launches(key, num_kv_heads, group, small, big, num_sms, num_splits)
        return found
    qsl = np.asarray(meta.query_start_loc, dtype=np.int64)
    qlens = np.diff(qsl)
    ctx = np.asarray(meta.context_lens, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
    launches = []
    for tile, seqs, prefill in zip((small, big), _classes(qlens, small["block_m"] // group), (False, True)):
        if len(seqs) == 0:
            continue
        item_seq, item_tok, keys = _items(qlens, ctx, seq_lens, seqs, tile["block_m"] // group)
        splits = num_splits or _choose_splits(
            len(item_seq) * num_kv_heads, int(keys.max()), num_sms
        )
        resident_key = None
        item_major = False
        if prefill:
            tile_key = _tile_key(device, tile, head_dim)
            resident = _RESIDENT.get(tile_key)
            resident_key = tile_key if resident is None else None
            item_major = _item_major(keys, num_kv_heads, num_sms * (resident or DEFAULT_RESIDENT))
        launches.append(
            Launch(
                item_seq=_upload(item_seq, np.int32, device),
                item_tok=_upload(item_tok, np.int32, device),
                num_items=len(item_seq),
                num_splits=int(splits),
                split_mask=prefill and int(keys.max()) >= SPLIT_MASK_KEYS,
                item_major=item_major,
                resident_key=resident_key,
                **tile,
            )
        )
    meta.device[key] = launches
    return launches


class MixedPlan:
    """The attention metadata of a captured mixed step: any mix of decodes and prefill chunks,
    at most ``max_seqs`` sequences and ``max_tokens`` tokens. The captured kernels read fixed
    device buffers, which ``fill`` rewrites before each replay (one int32 array: query starts,
    sequence and context lengths, the slot mapping and both launches' work items; the block
    tables are a ``[max_seqs + 1, max_blocks]`` buffer, which plans may share).

    Both launches always run, over as many work items as any step of the bucket can have.
    Sequence ``max_seqs`` is padding: no tokens, no keys. The items a step leaves unused point
    at it, and their programs exit after a few loads; the token rows past the step's are in no
    sequence and their slots are -1, so nothing reads or stores them. The split-K factor is
    fixed at capture: the short-query launch's for the longest sequence the engine allows (as
    in decode graphs), none for the prefill launch, whose items fill the GPU; the prefill launch
    never takes the unmasked loop of long key ranges (``SPLIT_MASK_KEYS``), a speed trade,
    not a change of result. ``device`` as the step's tensors report it (``cuda:0``, not
    ``cuda``): the kernels look the plan up by ``q.device``.
    """

    def __init__(self, meta, max_seqs: int, max_tokens: int, max_blocks: int, max_model_len: int,
                 device: torch.device, block_tables: torch.Tensor | None = None) -> None:
        self.max_seqs, self.max_tokens, self.max_model_len = max_seqs, max_tokens, max_model_len
        s, t = max_seqs, max_tokens
        # regions of the packed buffer: query starts (S + 2: the padding sequence's end too),
        # seq_lens, context_lens (S + 1), slots (T), then each launch's items and first tokens
        # (the short launch: one item a sequence; the prefill launch: at most T + S)
        sizes = [s + 2, s + 1, s + 1, t, s + 1, s + 1, t + s + 1, t + s + 1]
        self.host = np.zeros(sum(sizes), dtype=np.int32)
        self.buffer = torch.zeros(len(self.host), dtype=torch.int32, device=device)
        offsets = np.cumsum([0] + sizes)
        self._host_views = [self.host[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        views = [self.buffer[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        # ``block_tables`` may be shared by the plans of several graphs (one replays at a time,
        # each after writing its step's rows): at long context it is the largest buffer here
        if block_tables is None:
            block_tables = torch.zeros((s + 1, max_blocks), dtype=torch.int32, device=device)
        elif tuple(block_tables.shape) != (s + 1, max_blocks) or block_tables.dtype != torch.int32:
            raise ValueError(f"shared block tables must be int32 [{s + 1}, {max_blocks}], got "
                             f"{block_tables.dtype} {tuple(block_tables.shape)}")
        self.block_tables = block_tables
        meta.device[f"cuda.step@{device}"] = StepTensors(
            query_start_loc=views[0], seq_lens=views[1], context_lens=views[2],
            block_tables=self.block_tables, slot_mapping=views[3],
        )
        self._item_views = (views[4], views[5]), (views[6], views[7])
        self._key: str | None = None
        self._launches: list[tuple[Launch, int, int]] = []  # (launch, BLOCK_Q, class) to refill
        self.small_q = 0
        meta.device[f"cuda.mixed@{device}"] = self
        self.fill(meta)

    def launches(self, key: str, num_kv_heads: int, group: int, small: dict, big: dict, num_sms: int,
                 num_splits: int | None) -> list[Launch]:
        if self._key is not None and key != self._key:
            raise ValueError(f"a captured mixed step holds one attention shape: {self._key}, then {key}")
        if self._key is None:
            self._key = key
            s, t = self.max_seqs, self.max_tokens
            self.small_q = small["block_m"] // group
            big_q = big["block_m"] // group
            # items of the prefill launch: T // big_q blocks, plus one partial block a sequence
            # (a sequence there has more than small_q tokens)
            caps = (s + 1, min(t + s + 1, -(-t // big_q) + min(s, t // (self.small_q + 1)) + 1))
            short_splits = num_splits or _choose_splits(caps[0] * num_kv_heads, self.max_model_len, num_sms)
            for cls, (tile, cap, splits) in enumerate(zip((small, big), caps, (short_splits, num_splits or 1))):
                seq_view, tok_view = self._item_views[cls]
                launch = Launch(item_seq=seq_view[:cap], item_tok=tok_view[:cap], num_items=cap,
                                num_splits=int(splits), **tile)
                self._launches.append((launch, tile["block_m"] // group, cls))
        return [launch for launch, _, _ in self._launches]

    def fill(self, meta) -> np.ndarray:
        """Write ``meta`` (a step of at most ``max_seqs`` sequences and ``max_tokens`` tokens)
        into the host copy of the buffer and return it (for one upload into ``buffer``)."""
        qsl_v, seq_v, ctx_v, slot_v, *_ = self._host_views
        s, n = meta.num_seqs, len(meta.slot_mapping)
        if s > self.max_seqs or n > self.max_tokens:
            raise ValueError(f"a step of {s} sequences and {n} tokens exceeds the captured "
                             f"{self.max_seqs} and {self.max_tokens}")
        qsl = np.asarray(meta.query_start_loc, dtype=np.int64)
        qsl_v[: s + 1] = qsl
        qsl_v[s + 1 :] = n
        seq_v[:s] = meta.seq_lens
        seq_v[s:] = 0
        ctx_v[:s] = meta.context_lens
        ctx_v[s:] = 0
        slot_v[:n] = meta.slot_mapping
        slot_v[n:] = -1
        if self._launches:
            qlens = np.diff(qsl)
            ctx = np.asarray(meta.context_lens, dtype=np.int64)
            seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)
            classes = _classes(qlens, self.small_q)
            for launch, block_q, cls in self._launches:
                seq_h, tok_h = self._host_views[4 + 2 * cls], self._host_views[5 + 2 * cls]
                item_seq, item_tok, _ = _items(qlens, ctx, seq_lens, classes[cls], block_q)
                k = len(item_seq)
                if k > launch.num_items:  # the bound in ``launches`` rules it out
                    raise AssertionError(f"{k} work items for a launch captured with {launch.num_items}")
                cap = launch.num_items  # the launch's grid; the region past it is never read
                seq_h[:k] = item_seq
                seq_h[k:cap] = self.max_seqs  # the padding sequence
                tok_h[:k] = item_tok
                tok_h[k:cap] = 0
        return self.host


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """``key_cache[slot_mapping[n]] = k[n]`` (and v), cast to the cache dtype or quantized to
    its format (an int8 / uint8 cache, laid out in planes per block of ``block_size`` slots);
    slot < 0 skips."""
    _write(None, k, v, key_cache, value_cache, slot_mapping, block_size)


def rotary_write_kv_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    style: str,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``rotary`` then ``write_kv_cache`` in one launch: the rotated q (a new tensor), with the
    rotated k and v written to their slots."""
    check_table(style, cos_sin.shape[-1], q.shape[2])
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    positions = positions if positions.is_contiguous() else positions.contiguous()
    _write((positions, cos_sin, style, q, qo), k, v, key_cache, value_cache, slot_mapping, block_size)
    return qo


def _write(rotary, k, v, key_cache, value_cache, slot_mapping, block_size) -> None:
    """``_kv_write_kernel``'s launch; ``rotary``: ``(positions, cos_sin, style, q, qo)`` or None."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    positions, cos_sin, style, q, qo = rotary or (slot_mapping, k, "", k, k)  # unread without rotary
    num_q_heads = q.shape[1] if rotary else 0
    rot = cos_sin.shape[-1] if rotary else 0
    block_d = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, 4096 // block_d)))
    grid = (tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    _kv_write_kernel[grid](
        k, v, key_cache, value_cache, slot_mapping, positions, cos_sin, q, qo,
        num_q_heads, num_kv_heads, head_dim, rot, cos_sin.stride(0),
        q.stride(0), q.stride(1), qo.stride(0), qo.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1),
        ROTARY={"": 0, "neox": 1, "interleaved": 2}[style],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        KV_BLOCK_SIZE=int(block_size),
        KV_QUANT=KV_FORMATS.get(key_cache.dtype, 0),
        KV_TOP=KV_TOPS.get(key_cache.dtype, 0.0),
        num_warps=4 if block_h * block_d >= 1024 else 2,
        **pdl(k.device),
    )  # fmt: skip


def _check(q, k, v, key_cache, value_cache) -> None:
    quantized = key_cache.dtype in KV_FORMATS
    for name, t in (
        ("q", q),
        ("k", k),
        ("v", v),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        if not (quantized and name.endswith("cache")):
            check_float(f"attention {name}", t)
        if t.dim() != 3:
            raise ValueError(f"attention: {name} must be 3-D, got {tuple(t.shape)}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"attention: {name} needs a contiguous last axis")
    head_dim = q.shape[2]
    num_kv_heads = key_cache.shape[1]
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"attention: Hq={q.shape[1]} not a multiple of Hk={num_kv_heads}")
    row = head_dim + 2 if quantized else head_dim  # a quantized cache has a float16 scale a row
    for name, t, width in (
        ("k", k, head_dim),
        ("v", v, head_dim),
        ("key_cache", key_cache, row),
        ("value_cache", value_cache, row),
    ):
        if t.shape[1:] != (num_kv_heads, width):
            raise ValueError(
                f"attention: {name} shape {tuple(t.shape)} vs [*, {num_kv_heads}, {width}]"
            )
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError("attention: q, k, v need the same number of tokens")
    if key_cache.dtype != value_cache.dtype:
        raise ValueError("attention: key and value caches differ in dtype")
    if head_dim > 256:
        raise ValueError(f"attention: head_dim {head_dim} > 256 not supported")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta,
    scale: float,
    num_splits: int | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor, str] | None = None,
) -> torch.Tensor:
    """The contract's ``attention``: writes k/v into the cache, returns ``[N, Hq, D]`` in q's dtype.

    ``num_splits`` forces the split-K factor (for tests); None lets the planner choose.
    ``rotary``: ``(positions, cos_sin, style)``, the contract's ``rotary_attention``: q and k
    are rotated first, in the kernel that writes the cache.
    """
    key_cache, value_cache = kv_cache
    _check(q, k, v, key_cache, value_cache)
    tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    device = q.device
    out = torch.empty((tokens, num_q_heads, head_dim), dtype=q.dtype, device=device)
    if tokens == 0:
        return out
    st = step_tensors(meta, device)
    if rotary is None:
        write_kv_cache(k, v, key_cache, value_cache, st.slot_mapping, meta.block_size)
    else:
        positions, cos_sin, style = rotary
        q = rotary_write_kv_cache(positions, q, k, v, cos_sin, style, key_cache, value_cache, st.slot_mapping,
                                  meta.block_size)

    # Float32 dot operands when q is float32 or q and the cache differ in dtype ("wide": smaller
    # tiles). The interpreter also needs them for bfloat16: it runs tl.dot on the raw 16-bit
    # patterns (the tiles stay those a GPU would use).
    # A quantized cache's values are converted to q's dtype in the kernel.
    kv_quant = KV_FORMATS.get(key_cache.dtype, 0)
    cache_dtype = q.dtype if kv_quant else key_cache.dtype
    wide = q.dtype == torch.float32 or q.dtype != cache_dtype
    dot_f32 = wide or (interpreting() and torch.bfloat16 in (q.dtype, cache_dtype))
    precision = "ieee" if dot_f32 else "tf32"  # tf32 is ignored for 16-bit operands
    block_d = max(16, next_pow2(head_dim))
    qk_scale = float(scale) * LOG2E
    launches = plan_launches(meta, num_kv_heads, group, head_dim, device, num_splits, wide)
    for launch in launches:
        splits = launch.num_splits
        if splits > 1:
            if launch.scratch is None:
                rows = splits * launch.num_items * num_kv_heads * launch.block_m
                launch.scratch = (
                    torch.empty(rows, dtype=torch.float32, device=device),
                    torch.empty(rows, dtype=torch.float32, device=device),
                    torch.empty(rows * block_d, dtype=torch.float32, device=device),
                    # splits arrived per (item, kv head); the merging program zeroes its own
                    torch.zeros(launch.num_items * num_kv_heads, dtype=torch.int32, device=device),
                )
            part_m, part_l, part_acc, counts = launch.scratch
        else:
            part_m = part_l = part_acc = counts = out  # unused
        if launch.item_major:
            grid = (num_kv_heads, launch.num_items, splits)
        else:
            grid = (launch.num_items, num_kv_heads, splits)
        compiled = _attention_kernel[grid](
            q,
            key_cache,
            value_cache,
            out,
            part_m,
            part_l,
            part_acc,
            counts,
            launch.item_seq,
            launch.item_tok,
            st.query_start_loc,
            st.seq_lens,
            st.context_lens,
            st.block_tables,
            qk_scale,
            launch.num_items,
            num_kv_heads,
            int(launch.item_major),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            value_cache.stride(0),
            value_cache.stride(1),
            st.block_tables.stride(0),
            G=group,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n,
            KV_BLOCK_SIZE=int(meta.block_size),
            NUM_SPLITS=splits,
            DOT_F32=dot_f32,
            PRECISION=precision,
            KV_QUANT=kv_quant,
            EVEN_D=block_d == head_dim,
            SPLIT_MASK=launch.split_mask,
            TABLES_AHEAD=launch.tables_ahead,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
            **pdl(device),
        )
        if launch.resident_key is not None and launch.resident_key not in _RESIDENT:
            resident = resident_programs(device, compiled)
            if resident is not None:
                _RESIDENT[launch.resident_key] = resident
    return out


__all__ = ["MixedPlan", "paged_attention", "plan_launches", "rotary_write_kv_cache", "static_step_tensors", "step_tensors",
           "write_kv_cache"]
