"""wint4 at one row (a decode step of one sequence): ``y = x @ w.T`` from the ``cuda_w4`` layout,
the packed weight loaded straight into the tensor cores' registers. Written in Gluon (Triton's
layout-explicit dialect), which is what makes that possible.

Why not ``int4_gemv.py`` (which still serves two to four rows): there the packed tile is loaded
in a blocked layout and Triton moves it into the dot's operand layout through shared memory,
two bytes a thread at a time, and its x tile is a masked [k, 16] load a step; the large
Llama-3-8B shapes stream at 2.1-2.3 TB/s on an H200. Here (``benchmarks/bench_int4_decode.py``):

- A step is one packed chunk (``2 * half`` columns: byte i holds column i in its low nibble and
  column ``half + i`` in its high one). Each thread loads 16 contiguous bytes of a row, which
  are exactly its part of the ``mma.sync`` A operand for both halves (checked at
  compile time by ``assert_trivial``; ``w_layout``): PTX turns a word into four bf16/fp16 pairs (the nibble
  OR-ed into the mantissa of 128.0 / 1024.0) that are the instruction's registers as they are.
- The tile's k order is not the columns' order: bit 1 of k (a word's second pair) is moved to
  the top of the half, and x is loaded in that same order (``_x_half``), so that an
  instruction's two B registers are adjacent in x and come from one 16-byte load without moves
  (an MMA sums over k: any order shared by both operands gives the same sum).
- Scales (bfloat16, as ``pack_linear`` keeps them) multiply each step's two per-half sums in
  float32 (one group a half: ``half`` divides the group); zeros and the magic offset are one
  correction a row, ``sum over groups of (z - offset * s) * sum(x over the group)``, computed
  before the first step.
- Weights, scales and zeros are never written by a step, so the first two steps' tiles, their
  scales and the correction's scales and zeros are asked for before the programmatic-launch
  wait; afterwards the weights stay two steps ahead (a pair of steps a trip, so no tile moves
  registers) and are read ``evict_first``.
- Registers capped at 128: four programs of four warps per SM (uncapped: 130 registers, three
  programs; gate_up the same, o 5.9 -> 6.4 us, down 12.6 -> 16.5).
- Split K as in ``int4_gemv.py``, through the same per-device workspace and counters.

H200, µs a call in a CUDA graph, each call on another copy of the weight (group 128, zeros):
qkv 6144 x 4096 10.9 -> 8.6, o 4096 x 4096 8.1 -> 5.8, gate_up 28672 x 4096 30.5 -> 21.2,
down 4096 x 14336 16.0 -> 12.7 (``int4_gemv`` -> this kernel); the Llama-3-8B shape's batch-1
token 2.739 -> 2.417 ms. Slower and not kept: weights through a cp.async ring in shared memory,
or a TMA ring (3-6 stages, also with a warp-specialized producer: 5-50% slower), x one step
ahead in registers, x prefetched into L1 (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import functools

import torch
import triton
from fd_core.interfaces import QuantizedWeight

from fd_backend_cuda.kernels import int4_gemv
from fd_backend_cuda.kernels._common import capability, interpreting, pdl, pdl_start

try:  # Gluon: Triton 3.5 and later
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - an older Triton: int4_gemv serves every row count
    gluon = None

BLOCK_N = 64  # four warps of 16 rows
HALVES = (64, 128)  # the packed chunk's halves this kernel reads (a step is 32 or 64 bytes a row)
MAX_REGISTERS = 128


def _unpack_asm(magic_pair: int) -> str:
    """PTX for one word (bytes i..i+3: columns i..i+3 in the low nibbles, half+i.. in the high
    ones) -> pairs (i, i+1), (i+2, i+3) of the low half and the same of the high half, each
    nibble OR-ed into the mantissa of ``magic_pair``'s halves."""
    return f"""
    {{
    .reg .b32 t0, t1;
    prmt.b32 t0, $4, 0, 0x5140;
    prmt.b32 t1, $4, 0, 0x7362;
    lop3.b32 $0, t0, 0x000F000F, {magic_pair:#010x}, 0xEA;
    lop3.b32 $1, t1, 0x000F000F, {magic_pair:#010x}, 0xEA;
    shr.b32 t0, t0, 4;
    shr.b32 t1, t1, 4;
    lop3.b32 $2, t0, 0x000F000F, {magic_pair:#010x}, 0xEA;
    lop3.b32 $3, t1, 0x000F000F, {magic_pair:#010x}, 0xEA;
    }}
    """


_UNPACK = {dtype: _unpack_asm(pair) for dtype, (pair, _) in int4_gemv.MAGIC.items()}


if gluon is not None:
    BN = gl.constexpr(BLOCK_N)
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8]))
    A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8))
    B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8))
    # the correction: x's group sums [groups, group] and the rows' scales/zeros [rows, groups]
    XL = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
    CL = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
    # a row's two scales of a step (its halves' groups), in the threads holding the row's sums
    SL = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, 2]))

    def w_layout(half: int):
        """A step's words ``[BLOCK_N, half / 4]``: a thread's four adjacent words of rows r and
        r + 8 (and 64 bytes on, for half 128), which unpack into its A registers."""
        regs = [[0, 1], [0, 2], [8, 0]] + ([[0, 16]] if half == 128 else [])
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, half // 4])

    def x_layout(half: int):
        """Half a step of x ``[half, 8]``: 16 adjacent values a thread (and 64 on, for half 128),
        the same in every column."""
        regs = [[1, 0], [2, 0], [4, 0], [8, 0]] + ([[64, 0]] if half == 128 else [])
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],
                                          warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[half, 8])

    @gluon.jit
    def _a_half(p0, p1, DT: gl.constexpr):
        """Pairs (4j, 4j+1) and (4j+2, 4j+3) of each word j -> the half's A operand, k in the
        tile's order (``_x_half``)."""
        pairs = gl.join(p0, p1)
        lo = (pairs & 0xFFFF).to(gl.int16).to(DT, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(DT, bitcast=True)
        R: gl.constexpr = lo.shape[0]
        H: gl.constexpr = lo.shape[1] * 4
        v = gl.reshape(gl.join(lo, hi), [R, H // 64, 16, 2, 2])  # column 4j + 2p + e
        return gl.convert_layout(gl.reshape(gl.permute(v, (0, 1, 3, 2, 4)), [R, H]), A, assert_trivial=True)

    @gluon.jit
    def _x_half(ptr, H: gl.constexpr, XV: gl.constexpr):
        """x[0:H] as the B operand, k in the tile's order: bit 1 of the column moved to the top."""
        k = gl.arange(0, H, layout=gl.SliceLayout(1, XV))
        v = gl.load(ptr + k[:, None] + gl.arange(0, 8, layout=gl.SliceLayout(0, XV))[None, :] * 0)
        v = gl.reshape(gl.permute(gl.reshape(v, [H // 64, 16, 2, 2, 8]), (0, 2, 1, 3, 4)), [H, 8])
        return gl.convert_layout(v, B)

    @gluon.jit
    def _step(out, w, s, x_step, UNPACK: gl.constexpr, DT: gl.constexpr, H: gl.constexpr, XV: gl.constexpr):
        l0, l1, h0, h1 = gl.inline_asm_elementwise(UNPACK, "=r,=r,=r,=r,r", [w],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
        zero = gl.zeros_like(out)
        d_low = mma_v2(_a_half(l0, l1, DT), _x_half(x_step, H, XV), zero)
        d_high = mma_v2(_a_half(h0, h1, DT), _x_half(x_step + H, H, XV), zero)
        s_low, s_high = gl.split(s)
        s_low = gl.convert_layout(s_low, gl.SliceLayout(1, MMA), assert_trivial=True)
        s_high = gl.convert_layout(s_high, gl.SliceLayout(1, MMA), assert_trivial=True)
        return out + d_low * s_low[:, None] + d_high * s_high[:, None]

    @gluon.jit
    def _scale_cols(k_begin, g_begin, STEP: gl.constexpr, GROUP: gl.constexpr):
        """Where a program's first step's two scales are (a half lies in one group: ``H``
        divides ``GROUP``): groups, or columns where a group spans steps unevenly."""
        halves = gl.arange(0, 2, layout=gl.SliceLayout(0, SL))[None, :]
        if STEP % GROUP == 0:
            return g_begin + halves * (STEP // 2 // GROUP)
        else:
            return k_begin + halves * (STEP // 2)

    @gluon.jit
    def _scales_at(s_rows, s_cols, i, STEP: gl.constexpr, GROUP: gl.constexpr):
        """Step i's two scales' addresses: a constant stride where groups tile a step, else a
        division (groups of 512, or 384 across 256-column steps; cost the o shape's two-step
        programs ~0.4 us a call)."""
        if STEP % GROUP == 0:
            return s_rows + s_cols + i * (STEP // GROUP)
        else:
            return s_rows + (s_cols + i * STEP) // GROUP

    @gluon.jit
    def _correction(x_ptr, s_ptr, z_ptr, rn_l, g0, g_end, stride_sn, MAGIC: gl.constexpr, HAS_ZEROS: gl.constexpr,
                    GROUP: gl.constexpr, GP: gl.constexpr, GC: gl.constexpr, corr):
        """Rows' sum over groups g0..g0+GC of (z - MAGIC s) * sum(x over the group); ``corr``
        the first factor if already loaded, else None."""
        rg_l = gl.arange(0, GC, layout=gl.SliceLayout(0, CL))
        if corr is None:
            sz = rn_l[:, None] * stride_sn + (g0 + rg_l)[None, :]
            ok = ((g0 + rg_l) < g_end)[None, :]
            corr = -MAGIC * gl.load(s_ptr + sz, mask=ok, other=0.0).to(gl.float32)
            if HAS_ZEROS:
                corr += gl.load(z_ptr + sz, mask=ok, other=0.0).to(gl.float32)
        rg = gl.arange(0, GC, layout=gl.SliceLayout(1, XL))
        rx = gl.arange(0, GP, layout=gl.SliceLayout(0, XL))  # GP: the group rounded up to a power of two
        ok = ((g0 + rg) < g_end)[:, None] & (rx < GROUP)[None, :]
        xs = gl.sum(gl.load(x_ptr + (g0 + rg)[:, None] * GROUP + rx[None, :], mask=ok, other=0.0).to(gl.float32),
                    axis=1)
        return gl.sum(corr * gl.convert_layout(xs, gl.SliceLayout(0, CL))[None, :], axis=1)

    @gluon.jit
    def _int4_row_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, K_SPLIT, K_SPLIT_WORDS,
                         stride_wn, stride_sn, H: gl.constexpr, GROUP: gl.constexpr, HAS_ZEROS: gl.constexpr,
                         SPLIT: gl.constexpr, UNPACK: gl.constexpr, DT: gl.constexpr, MAGIC: gl.constexpr,
                         WL: gl.constexpr, XV: gl.constexpr, GP: gl.constexpr, GC: gl.constexpr, PDL: gl.constexpr):
        STEP: gl.constexpr = 2 * H
        WORDS: gl.constexpr = H // 4
        pid_n = gl.program_id(0)
        pid_k = gl.program_id(1)
        k_begin = pid_k * K_SPLIT
        k_end = gl.minimum(k_begin + K_SPLIT, K)
        last = (k_end - k_begin) // STEP - 1
        g_begin = k_begin // GROUP
        g_end = k_end // GROUP
        rn_w = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, WL))
        rw = gl.arange(0, WORDS, layout=gl.SliceLayout(0, WL))
        w_tile = (w_ptr + pid_k * K_SPLIT_WORDS) + gl.minimum(rn_w, N - 1).to(gl.int64)[:, None] * (stride_wn // 4) \
            + rw[None, :]
        rn_s = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, SL)), N - 1).to(gl.int64)
        s_rows = s_ptr + rn_s[:, None] * stride_sn
        s_cols = _scale_cols(k_begin, g_begin, STEP, GROUP)
        rn_l = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, CL)), N - 1).to(gl.int64)
        # weights, scales and zeros only, before the wait: no kernel of a step writes them
        wa = gl.load(w_tile, eviction_policy="evict_first")
        wb = gl.load(w_tile + gl.minimum(1, last) * WORDS, eviction_policy="evict_first")
        sa = gl.load(_scales_at(s_rows, s_cols, 0, STEP, GROUP)).to(gl.float32)
        sb = gl.load(_scales_at(s_rows, s_cols, gl.minimum(1, last), STEP, GROUP)).to(gl.float32)
        rg_l = gl.arange(0, GC, layout=gl.SliceLayout(0, CL))
        sz = rn_l[:, None] * stride_sn + (g_begin + rg_l)[None, :]
        ok = ((g_begin + rg_l) < g_end)[None, :]
        corr = -MAGIC * gl.load(s_ptr + sz, mask=ok, other=0.0).to(gl.float32)
        if HAS_ZEROS:
            corr += gl.load(z_ptr + sz, mask=ok, other=0.0).to(gl.float32)
        pdl_start(PDL)
        # the dot's values are MAGIC + q: x . (q s + z) = dot s + sum(x) (z - MAGIC s), by group
        term = _correction(x_ptr, s_ptr, z_ptr, rn_l, g_begin, g_end, stride_sn, MAGIC, HAS_ZEROS, GROUP, GP, GC, corr)
        for g0 in range(g_begin + GC, g_end, GC):
            term += _correction(x_ptr, s_ptr, z_ptr, rn_l, g0, g_end, stride_sn, MAGIC, HAS_ZEROS, GROUP, GP, GC, None)
        out = gl.zeros([BN, 8], gl.float32, MMA)
        # weights two steps ahead; a pair of steps a trip, so no tile moves registers
        for i in range(0, last, 2):
            out = _step(out, wa, sa, x_ptr + k_begin + i * STEP, UNPACK, DT, H, XV)
            wa = gl.load(w_tile + gl.minimum(i + 2, last) * WORDS, eviction_policy="evict_first")
            sa = gl.load(_scales_at(s_rows, s_cols, gl.minimum(i + 2, last), STEP, GROUP)).to(gl.float32)
            out = _step(out, wb, sb, x_ptr + k_begin + (i + 1) * STEP, UNPACK, DT, H, XV)
            wb = gl.load(w_tile + gl.minimum(i + 3, last) * WORDS, eviction_policy="evict_first")
            sb = gl.load(_scales_at(s_rows, s_cols, gl.minimum(i + 3, last), STEP, GROUP)).to(gl.float32)
        if (last + 1) % 2 == 1:
            out = _step(out, wa, sa, x_ptr + k_begin + last * STEP, UNPACK, DT, H, XV)
        rn_c = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))
        # every column of the dot is the same row of x: take the first
        first = (gl.arange(0, 8, layout=gl.SliceLayout(0, MMA)) == 0)[None, :]
        res = gl.sum(gl.where(first, out, 0.0), axis=1) + gl.convert_layout(term, gl.SliceLayout(1, MMA))
        n_ok = rn_c < N
        if SPLIT:  # the programs of a row tile add into the workspace; the last one writes y
            work = ws_ptr + rn_c
            gl.atomic_add(work, res, mask=n_ok, sem="relaxed")
            gl.thread_barrier()  # every thread's add before the arrival (release) below
            arrived = gl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
            if arrived == gl.num_programs(1) - 1:
                total = gl.atomic_xchg(work, gl.zeros_like(res), mask=n_ok, sem="relaxed")
                gl.store(y_ptr + rn_c, total.to(y_ptr.dtype.element_ty), mask=n_ok)
                gl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")
        else:
            gl.store(y_ptr + rn_c, res.to(y_ptr.dtype.element_ty), mask=n_ok)

    @functools.cache
    def _layouts(half: int):
        return w_layout(half), x_layout(half)


def serves(rows: int, dtype: torch.dtype, weight: QuantizedWeight, half: int) -> bool:
    """What the kernel computes, whatever the device: one row of bf16/fp16, chunks of 128 or 256
    columns, each half-chunk within one group (``pack_linear`` picks ``half`` dividing the group)."""
    return rows == 1 and dtype in _UNPACK and half in HALVES and weight.group_size % half == 0


def supports(x2: torch.Tensor, weight: QuantizedWeight, half: int) -> bool:
    """``serves`` on an sm80-sm90 GPU with Gluon present. mma.sync with bf16 from sm80; compiled
    for sm80 and sm90, run on sm90 only, so newer architectures keep int4_gemv.py (plain Triton)
    until it has run there. The kernel also needs ``int4_gemv.supports`` (its workspace,
    reserved by ``pack_linear``), which ``quantized_linear.linear`` asks first."""
    return (gluon is not None and x2.is_cuda and not interpreting() and x2.stride(-1) == 1
            and serves(x2.shape[0], x2.dtype, weight, half) and 8 <= capability(x2.device)[0] <= 9)


def int4_row(x2: torch.Tensor, weight: QuantizedWeight, half: int, sms: int) -> torch.Tensor:
    """``x2`` ``[1, in]`` times the ``cuda_w4`` weight (half-chunks of ``half`` columns):
    ``[1, out]``."""
    out_features, in_features = weight.shape
    grid, k_split = int4_gemv.split_k(out_features, in_features, 2 * half, sms, min_steps=2)
    ws, counters = int4_gemv.workspace(x2.device)
    y = torch.empty((1, out_features), dtype=x2.dtype, device=x2.device)
    group = weight.group_size
    zeros = weight.zeros
    w_l, x_l = _layouts(half)
    _int4_row_kernel[grid](
        x2, weight.qweight.view(torch.int32), weight.scales, weight.scales if zeros is None else zeros, y, ws, counters,
        out_features, in_features, k_split, k_split // 8, weight.qweight.stride(0), weight.scales.stride(0),
        H=half, GROUP=group, HAS_ZEROS=zeros is not None, SPLIT=grid[1] > 1, UNPACK=_UNPACK[x2.dtype],
        DT=gl.bfloat16 if x2.dtype == torch.bfloat16 else gl.float16, MAGIC=int4_gemv.MAGIC[x2.dtype][1],
        WL=w_l, XV=x_l, GP=triton.next_power_of_2(group), GC=min(32, triton.next_power_of_2(max(1, k_split // group))),
        num_warps=4, maxnreg=MAX_REGISTERS, **pdl(x2.device))
    return y
