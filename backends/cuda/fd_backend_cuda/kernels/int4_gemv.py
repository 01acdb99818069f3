"""wint4 at batch 1 to 4 (a decode step of one to four sequences): ``y = x @ w.T`` from the
``cuda_w4`` layout at close to HBM speed.

Why a kernel of its own: the tiled kernel of ``quantized_linear`` pads the one row to 16 and
applies the group scales after every K step; at one row that loop, not the memory, bounds it
(0.65-0.93 TB/s on Llama-3-8B's shapes, H100). Here (``benchmarks/bench_int4_decode.py``):

- the weight is the dot's A operand (``BLOCK_N`` rows, Hopper's wgmma reads it from registers)
  and the unpacking is PTX (two bytes become two bf16/fp16 pairs in four instructions: the
  nibble OR-ed into the mantissa of 128.0 / 1024.0, the offset taken off after the dot);
- the dot's ``COLS`` output columns are ``COLS`` different (row of x, half-chunk) pairs: x is
  loaded as the B tile with a row's values in its column for chunk ``c``'s low or high half
  and zeros elsewhere (zero-filled by the copy, not read), so each column collects one
  half-chunk's raw sum, and the scales, zeros and offset are applied once per block of
  ``COLS / rows`` half-chunks instead of per step;
- a step reads ``HB`` bytes of each row, which keeps the unpacked tile's registers (and the
  registers capped at 128) low enough for four programs per SM;
- split K needs no zeroed output and no cast after: the programs of an output tile add into a
  float32 workspace and the last one to arrive reads it back (zeroing it) and writes ``y``. The
  workspace is one per device, reserved at load by ``reserve``, used by one kernel at a time
  (the engine runs its steps on one stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fd_core.interfaces import QuantizedWeight

from fd_backend_cuda.kernels._common import device_index, pdl, pdl_start

BLOCK_N = 64
COLS = 16
HB = 64
MAX_ROWS = 4  # rows of x the dot's COLS columns are shared among (COLS / rows half-chunks a block)
# four programs of 4 warps per SM; left to itself ptxas took 128-165 by the variant, and fewer
# programs per SM cost a third of the speed (gate_up 44.5 against 33.2 us)
MAX_REGISTERS = 128
_WORKSPACE: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
# workspaces outgrown by a later load, kept: a CUDA graph captured before may still point at them
_RETIRED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _unpack_asm(magic_pair: int) -> str:
    """PTX for two bytes (the wgmma A fragment's k pair) -> the pair of low nibbles and the pair
    of high nibbles, each OR-ed into the mantissa of ``magic_pair``'s halves (MAGIC + nibble)."""
    return f"""
    {{
    .reg .b32 t0, t1;
    cvt.u32.u16 t0, $2;
    prmt.b32 t0, t0, 0, 0x4140;
    lop3.b32 $0, t0, 0x000F000F, {magic_pair:#010x}, 0xEA;
    shr.b32 t1, t0, 4;
    lop3.b32 $1, t1, 0x000F000F, {magic_pair:#010x}, 0xEA;
    }}
    """


# bf16 128 + nibble and fp16 1024 + nibble are exact: a pair of either in one word, and the
# dot's excess (MAGIC + 8) * sum(x), taken off after it (int4_row.py unpacks the same way)
MAGIC = {torch.bfloat16: (0x43004300, 136.0), torch.float16: (0x64006400, 1032.0)}
_UNPACK = {dtype: (_unpack_asm(pair), offset) for dtype, (pair, offset) in MAGIC.items()}


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, K_SPLIT, stride_xm, stride_ym,
                      stride_wn, stride_sn, HAS_ZEROS: tl.constexpr, SPLIT: tl.constexpr, UNPACK: tl.constexpr,
                      MAGIC_OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, H: tl.constexpr, HB: tl.constexpr,
                      COLS: tl.constexpr, HALVES: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    # ROWS rows of x (a power of two, M of them real) share the dot's COLS columns: column
    # m * G + j holds row m's half-chunk j of the block, G = COLS / ROWS half-chunks a block
    G: tl.constexpr = COLS // ROWS
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N read row N - 1, never stored
    w_rows = w_ptr + rows[:, None] * stride_wn
    col = tl.arange(0, COLS)
    col_row = col // G  # the row of x a column belongs to
    col_half = col % G  # and its half-chunk within the block
    col_ok = col_row < M
    x_cols = x_ptr + col_row.to(tl.int64) * stride_xm
    out = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    CHUNKS: tl.constexpr = G // 2
    SUB: tl.constexpr = H // HB
    for b0 in range(k_begin, k_end, CHUNKS * 2 * H):
        acc = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
        for i in range(0, tl.minimum(CHUNKS, (k_end - b0) // (2 * H)) * SUB):
            c = i // SUB
            part = (i % SUB) * HB  # the step's bytes within the chunk's H
            packed = tl.load(w_rows + b0 // 2 + c * H + part + tl.arange(0, HB)[None, :])
            dtype = x_ptr.dtype.element_ty
            low, high = tl.inline_asm_elementwise(UNPACK, "=r,=r,h", [packed], dtype=(dtype, dtype),
                                                  is_pure=True, pack=2)
            rk = b0 + c * 2 * H + part + tl.arange(0, HB)
            x_low = tl.load(x_cols[None, :] + rk[:, None], mask=(col_ok & (col_half == 2 * c))[None, :], other=0.0)
            x_high = tl.load(x_cols[None, :] + H + rk[:, None], mask=(col_ok & (col_half == 2 * c + 1))[None, :],
                             other=0.0)
            acc = tl.dot(low, x_low, acc)
            acc = tl.dot(high, x_high, acc)
        # column j's half-chunk starts at b0 + (j % G) * H: its group (HALVES half-chunks to a
        # group), and the sum of its row's x there
        start = b0 + col_half * H
        j_ok = (start < k_end) & col_ok
        g = (b0 // H + col_half) // HALVES
        s = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :], mask=j_ok[None, :], other=0.0).to(tl.float32)
        xs = tl.sum(tl.load(x_cols[:, None] + start[:, None] + tl.arange(0, H)[None, :], mask=j_ok[:, None],
                            other=0.0).to(tl.float32), axis=1)
        # x . (q s + z) with the dot's values MAGIC + q + 8: dot s - (MAGIC + 8) s sum(x) + z sum(x)
        corr = MAGIC_OFFSET * s
        if HAS_ZEROS:
            corr -= tl.load(z_ptr + rows[:, None] * stride_sn + g[None, :], mask=j_ok[None, :],
                            other=0.0).to(tl.float32)
        out += tl.sum(tl.reshape(acc * s - corr * xs[None, :], (BLOCK_N, ROWS, G)), axis=2)
    rm = tl.arange(0, ROWS)
    ok = n_ok[:, None] & (rm < M)[None, :]
    if SPLIT:
        work = ws_ptr + rm[None, :] * N + rn[:, None]
        tl.atomic_add(work, out, mask=ok, sem="relaxed")
        tl.debug_barrier()  # every thread's add before the arrival (release) below
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            total = tl.atomic_xchg(work, tl.zeros_like(out), mask=ok, sem="relaxed")
            tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed")
    else:
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty), mask=ok)


def reserve(device: torch.device, out_features: int) -> None:
    """Make the device's split-K workspace (zeroed, self-cleaning) large enough for
    ``out_features`` outputs. Called at load (``pack_linear``): never inside a graph capture."""
    index = device_index(device)
    tiles = triton.cdiv(out_features, BLOCK_N)
    have = _WORKSPACE.get(index)
    if have is None or have[1].numel() < tiles:
        if have is not None:
            _RETIRED.append(have)
        _WORKSPACE[index] = (torch.zeros(MAX_ROWS * tiles * BLOCK_N, dtype=torch.float32, device=device),
                             torch.zeros(tiles, dtype=torch.int32, device=device))


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's split-K workspace and arrival counters (``reserve``): int4_row.py's too."""
    return _WORKSPACE[device_index(device)]


def split_k(out_features: int, in_features: int, step: int, sms: int, min_steps: int) -> tuple[tuple[int, int], int]:
    """The grid and the columns a program takes: K split in powers of two until there are two
    programs per SM (``BLOCK_N`` rows each), as long as a program keeps ``min_steps`` steps of
    ``step`` columns; a program's columns a multiple of ``step``."""
    split = 1
    while (triton.cdiv(out_features, BLOCK_N) * split < 2 * sms
           and in_features // (split * 2) >= min_steps * step):
        split *= 2
    k_split = triton.cdiv(triton.cdiv(in_features, split), step) * step
    return (triton.cdiv(out_features, BLOCK_N), triton.cdiv(in_features, k_split)), k_split


def supports(x2: torch.Tensor, weight: QuantizedWeight, half: int) -> bool:
    """Up to ``MAX_ROWS`` rows of bf16/fp16 activations, half-chunks of whole ``HB`` steps, a
    workspace reserved."""
    if not x2.is_cuda:
        return False
    have = _WORKSPACE.get(device_index(x2.device))
    return (x2.shape[0] <= MAX_ROWS and x2.dtype in (torch.bfloat16, torch.float16) and half % HB == 0
            and have is not None and have[1].numel() >= triton.cdiv(weight.shape[0], BLOCK_N))


def int4_gemv(x2: torch.Tensor, weight: QuantizedWeight, half: int, sms: int) -> torch.Tensor:
    """``x2`` ``[m, in]`` (m up to ``MAX_ROWS``) times the ``cuda_w4`` weight (half-chunks of
    ``half`` columns): ``[m, out]``."""
    out_features, in_features = weight.shape
    m = x2.shape[0]
    rows = 1 if m == 1 else 2 if m == 2 else 4
    grid, k_split = split_k(out_features, in_features, 2 * half, sms, min_steps=1)
    y = torch.empty((m, out_features), dtype=x2.dtype, device=x2.device)
    ws, counters = workspace(x2.device)
    unpack, offset = _UNPACK[x2.dtype]
    zeros = weight.zeros
    _int4_gemv_kernel[grid](
        x2, weight.qweight, weight.scales, weight.scales if zeros is None else zeros, y, ws, counters,
        m, out_features, in_features, k_split, x2.stride(0), y.stride(0), weight.qweight.stride(0),
        weight.scales.stride(0),
        HAS_ZEROS=zeros is not None, SPLIT=grid[1] > 1, UNPACK=unpack,
        MAGIC_OFFSET=offset, BLOCK_N=BLOCK_N, H=half, HB=HB, COLS=COLS,
        HALVES=weight.group_size // half, ROWS=rows, num_warps=4, num_stages=4, maxnreg=MAX_REGISTERS,
        **pdl(x2.device))
    return y
