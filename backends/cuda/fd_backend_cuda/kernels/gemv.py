"""Plain (unquantized) ``y = x @ w.T (+ bias)`` for 1 to 4 rows of x: a decode step of one to
four sequences, float16 / bfloat16 / float32, weight ``[N, K]`` row-major (nn.Linear's layout).
And for one row, 8-bit weights (``gemv_8bit``: wint8 per channel, block_wise_fp8), which the
quantized ``linear`` (``quantized_linear.py``) hands here.

Why a kernel of its own: at one row cuBLAS picks kernels that reach ~1 TB/s on small weights
(H200, inside a CUDA graph: 13 µs for ERNIE-0.3B's 1024×2048 o_proj, a split-K pair of kernels
for its down projection), while the step is pure weight streaming (``benchmarks/bench_gemv.py``).

Design. Each program owns ``BLOCK_N`` rows of the weight and walks K in ``BLOCK_K`` steps, its
loads coalesced along K; the weight is read once (``evict_first``), x stays in cache. Small
``BLOCK_N`` (1-16) gives two or more programs per SM even at N = 1024, so there is no split K:
one kernel, no workspace, every output summed in one fixed order, deterministic results.

- CUDA cores (``_gemv_kernel``): products accumulated per (row, column) in float32, reduced
  once at the end; 16 weight elements per thread a step, and with ``prefetch`` the next step's
  tile is loaded before this one is used (Triton's ``num_stages`` pipelines only loads that
  feed a dot, so it does nothing here). The first tile is loaded before the programmatic-launch
  wait (``pdl_start``): weights are never written by a step's kernels, so a program streams
  while the kernel ahead of it (a norm, attention, SiLU) finishes (H200, batch 1 of the
  ERNIE-4.5-0.3B shape: 535 -> 514 µs of GPU time a step). Rows of x past the real ``m``
  (rounded up to 1, 2 or 4 at compile time) re-read the last real row and are never stored;
  weight rows past N re-read row N - 1: whole tiles load without masks.
- Tensor cores (``_gemv_dot_kernel``, 16-bit only): with 2-4 rows the CUDA cores do 2-4 FMAs
  and conversions per weight element and become the limit on large weights (Llama-3-8B's
  gate_up at 4 rows: 74 µs against cuBLAS' 55). The weight tile is the dot's A operand and x,
  zero-padded to 16 rows, its B, so ``BLOCK_N >= 16``; Triton pipelines the tiles through
  shared memory. Used where there are enough rows of N to fill the SMs with such programs.

The launch configuration comes from ``choose_config``, a rule fitted to a sweep on an H200
(``bench_gemv.py --sweep``: within 8% of the best configuration swept on every shape there),
not ``triton.autotune``, which would benchmark inside a graph capture; ``gemv(...,
config=...)`` overrides it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fd_backend_cuda.kernels._common import FLOAT_DTYPES, interpreting, next_pow2, pdl, pdl_start, sm_count

MAX_ROWS = 4
# gemv_8bit's weights: int8 with one scale a row (wint8 per channel; _gemv_kernel's SCALES);
# float8 e4m3 bits with one scale per 128 x 128 block (block_wise_fp8; _gemv_fp8_kernel)
NO_SCALES, ROW_SCALES, FP8_BLOCKS = 0, 1, 2


class Config(NamedTuple):
    """One launch: weight rows a program, K per step, warps, whether the CUDA-core kernel loads
    the next step's tile early, whether the tensor-core kernel runs instead (``block_n >= 16``),
    and that kernel's pipeline depth (the CUDA-core kernel ignores ``num_stages``)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    prefetch: bool = False
    dot: bool = False
    num_stages: int = 3


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                 HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, SCALES: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    rk0 = tl.arange(0, BLOCK_K)
    # The first weight tile is asked for before waiting on the kernel ahead: no kernel of a step
    # writes weights, so this read cannot race, and its DRAM latency overlaps the kernel ahead
    # (a norm, attention, SiLU: short kernels with few programs) instead of following it.
    # Everything else (x, y, the bias) waits.
    if EVEN_K:
        w_next = tl.load(w_rows + rk0[None, :], eviction_policy="evict_first")
    else:
        w_next = tl.load(w_rows + rk0[None, :], mask=(rk0 < K)[None, :], other=0.0, eviction_policy="evict_first")
    pdl_start(PDL)
    # up to four rows of x, one accumulator each (unused ones are folded away at compile time)
    x0 = x_ptr
    x1 = x_ptr + tl.minimum(1, M - 1) * stride_xm
    x2 = x_ptr + tl.minimum(2, M - 1) * stride_xm
    x3 = x_ptr + tl.minimum(3, M - 1) * stride_xm
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        k_ok = rk < K
        w = w_next.to(tl.float32)
        if PREFETCH:
            # the next step's tile is asked for before this one is used: two tiles in flight
            # (Triton's num_stages pipelines only loads that feed a dot)
            w_next = tl.load(w_rows + BLOCK_K + rk[None, :], mask=(rk + BLOCK_K < K)[None, :], other=0.0,
                             eviction_policy="evict_first")
        for r in tl.static_range(ROWS):
            x_row = x0 if r == 0 else x1 if r == 1 else x2 if r == 2 else x3
            # loaded in the weight tile's shape, hence its layout: a [BLOCK_K] vector gets another
            # layout and a trip through shared memory every step; ptxas drops the repeated loads
            x_tile = tl.broadcast_to(x_row + rk[None, :], (BLOCK_N, BLOCK_K))
            if EVEN_K:
                xv = tl.load(x_tile)
            else:
                xv = tl.load(x_tile, mask=k_ok[None, :], other=0.0)
            part = w * xv.to(tl.float32)
            if r == 0:
                acc0 += part
            elif r == 1:
                acc1 += part
            elif r == 2:
                acc2 += part
            else:
                acc3 += part
        if not PREFETCH:
            if k0 + BLOCK_K < K:  # one tile in flight: the next is asked for once this one is used
                if EVEN_K:
                    w_next = tl.load(w_rows + BLOCK_K + rk[None, :], eviction_policy="evict_first")
                else:
                    w_next = tl.load(w_rows + BLOCK_K + rk[None, :], mask=(rk + BLOCK_K < K)[None, :], other=0.0,
                                     eviction_policy="evict_first")
    n_ok = rn < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if SCALES:
        scale = tl.load(s_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_sn)
    for r in tl.static_range(ROWS):
        out = tl.sum(acc0 if r == 0 else acc1 if r == 1 else acc2 if r == 2 else acc3, axis=1)
        if SCALES:  # int8: one scale a row, applied once to the sum
            out *= scale
        if HAS_BIAS:
            out += bias
        tl.store(y_ptr + r * stride_ym + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok & (r < M))


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, K, stride_wn, stride_sn,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, EVEN_K: tl.constexpr,
                     PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """One row of x against float8 e4m3 weights with a scale per 128 x 128 block: tiles of
    ``[BLOCK_N, BLOCKS, 128]``, so a step spans ``BLOCKS`` scale blocks (a step of one block
    kept 16 bytes a thread in flight: 0.8-1.2 TB/s on an H200) and each scale multiplies its
    block's 128 values in registers."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(rn, N - 1).to(tl.int64)
    w_rows = w_ptr + rows[:, None, None] * stride_wn
    blk = tl.arange(0, BLOCKS)
    cols = blk[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    BLOCK_K: tl.constexpr = BLOCKS * 128
    # weights are never written by a step: the first tile is asked for before the launch wait
    if EVEN_K:
        w_next = tl.load(w_rows + cols, eviction_policy="evict_first")
    else:
        w_next = tl.load(w_rows + cols, mask=cols < K, other=0, eviction_policy="evict_first")
    pdl_start(PDL)
    s_rows = s_ptr + (rows // 128)[:, None] * stride_sn  # each row's 128-row block
    acc = tl.zeros((BLOCK_N, BLOCKS, 128), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + cols
        s = tl.load(s_rows + (k0 // 128 + blk)[None, :], mask=((k0 + blk * 128) < K)[None, :], other=0.0)
        w = w_next.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, :, None]
        if PREFETCH:
            w_next = tl.load(w_rows + BLOCK_K + rk, mask=rk + BLOCK_K < K, other=0, eviction_policy="evict_first")
        x_tile = tl.broadcast_to(x_ptr + rk, (BLOCK_N, BLOCKS, 128))
        if EVEN_K:
            xv = tl.load(x_tile)
        else:
            xv = tl.load(x_tile, mask=rk < K, other=0.0)
        acc += w * xv.to(tl.float32)
        if not PREFETCH:
            if k0 + BLOCK_K < K:
                w_next = tl.load(w_rows + BLOCK_K + rk, mask=rk + BLOCK_K < K, other=0,
                                 eviction_policy="evict_first")
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    n_ok = rn < N
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     UPCAST: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    # the weight tile is the dot's A operand, x's rows (zero-padded to 16) its B columns; Triton
    # pipelines the tiles through shared memory (num_stages)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    rm = tl.arange(0, 16)
    x_rows = x_ptr + rm[:, None] * stride_xm
    m_ok = rm < M
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + rk[None, :], eviction_policy="evict_first")
            xt = tl.load(x_rows + rk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            k_ok = rk < K
            w = tl.load(w_rows + rk[None, :], mask=k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # Triton 3.6's interpreter gets bfloat16 dots wrong (values ~1e10)
            w = w.to(tl.float32)
            xt = xt.to(tl.float32)
        acc = tl.dot(w, tl.trans(xt), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(rn < N)[:, None] & m_ok[None, :])


def _step(k: int, cap: int) -> int:
    """K per step: the largest power of two up to ``cap`` (at least 256) that divides K, so that
    steps need no masks; ``cap`` (bounded by K) where none does."""
    step = cap
    while step > 256 and k % step:
        step //= 2
    return step if k % step == 0 else min(cap, max(next_pow2(k), 16))


def choose_config(m: int, n: int, k: int, sms: int = 132, tensor_cores: bool = True) -> Config:
    """The launch for ``m`` rows and an ``[n, k]`` weight on a GPU of ``sms`` multiprocessors
    (``tensor_cores``: the dtype is 16-bit).

    Tensor cores from 2 rows where ``rows * n >= 16384`` (the crossover measured on an H200:
    Llama-3-8B's N = 4096 at 4 rows, its 28672 and ERNIE's 103424 at 2); their programs as
    large as still gives one per SM. Otherwise CUDA cores, 16 weight elements per thread a
    step (4 warps; 8 at 2 rows), programs of the most weight rows (at most 2 at one row, 16
    else) that still leave two per SM, the next step prefetched (not at 2 rows; where there is
    one: a prefetch of nothing cost ERNIE's LM head a fifth at one row)."""
    rows = 1 if m == 1 else 2 if m == 2 else 4
    if tensor_cores and rows > 1 and rows * n >= 16384:
        block_n = 64 if triton.cdiv(n, 64) >= sms else 32 if triton.cdiv(n, 32) >= sms else 16
        return Config(block_n, min(8192 // block_n, max(next_pow2(k), 16)), 4, dot=True,
                      num_stages=4 if block_n == 64 else 3)
    warps = 8 if rows == 2 else 4
    block_n = 1
    while block_n < (2 if rows == 1 else 16) and n // (2 * block_n) >= 2 * sms:
        block_n *= 2
    block_k = _step(k, max(256, 16 * 32 * warps // block_n))
    return Config(block_n, block_k, warps, prefetch=rows != 2 and k > block_k)


def supports(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` takes these operands: CUDA tensors (or CPU ones under Triton's
    interpreter), x ``[m, K]`` with 1 to 4 rows and a unit stride along K, a contiguous
    ``[N, K]`` weight of x's dtype (float16, bfloat16 or float32)."""
    on_device = x2.is_cuda and weight.is_cuda and x2.device == weight.device
    on_cpu = interpreting() and x2.device.type == "cpu" and weight.device.type == "cpu"
    return ((on_device or on_cpu) and x2.dim() == 2 and weight.dim() == 2
            and 1 <= x2.shape[0] <= MAX_ROWS and x2.dtype in FLOAT_DTYPES and weight.dtype == x2.dtype
            and weight.shape[1] == x2.shape[1] and weight.is_contiguous()
            and (x2.shape[1] <= 1 or x2.stride(1) == 1))


def gemv(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: Config | None = None) -> torch.Tensor:
    """``x2 [m, K] @ weight[N, K].T (+ bias[N])`` -> ``[m, N]`` in x's dtype, for operands that
    ``supports`` accepts; ``config`` overrides ``choose_config`` (for benchmarks)."""
    m, k = x2.shape[0], weight.shape[1]
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    if n == 0:
        return y
    if k == 0:  # the kernel reads its first weight tile unconditionally: no launch on nothing
        return y.zero_() if bias is None else y.copy_(bias.expand(m, n))
    if config is None:
        config = choose_config(m, n, k, sm_count(x2.device, otherwise=132), x2.dtype != torch.float32)
    if bias is not None:
        bias = bias.contiguous()
    grid = (triton.cdiv(n, config.block_n),)
    if config.dot:
        _gemv_dot_kernel[grid](
            x2, weight, weight if bias is None else bias, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            EVEN_K=k % config.block_k == 0, UPCAST=interpreting(), num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl(x2.device))
        return y
    _launch(x2, weight, None, NO_SCALES, bias, y, config)
    return y


def _launch(x2, weight, scales, kind, bias, y, config: Config) -> None:
    """``_gemv_kernel`` over ``y``'s rows; ``scales`` as ``kind`` (NO_SCALES: unread)."""
    m, k = x2.shape[0], x2.shape[1]
    n = y.shape[1]
    rows = 1 if m == 1 else 2 if m == 2 else 4
    scales = weight if scales is None else scales
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x2, weight, scales, weight if bias is None else bias, y, m, n, k, x2.stride(0), weight.stride(0),
        scales.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ROWS=rows, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0, PREFETCH=config.prefetch and k > config.block_k, SCALES=kind,
        num_warps=config.num_warps, num_stages=1, **pdl(x2.device))


def choose_config_8bit(n: int, k: int, kind: int, sms: int = 132) -> Config:
    """One row against an int8 (``ROW_SCALES``) or float8 (``FP8_BLOCKS``: ``block_k`` a
    multiple of 128) ``[n, k]`` weight: programs of two rows where that still gives two per SM,
    the next step prefetched, 32 int8 bytes a thread a step, 16 float8 ones (its conversions
    and per-block scaling cost more registers a value). The best of the launches swept on every
    Llama-3-8B shape on an H200 (``benchmarks/bench_8bit_gemv.py --sweep``)."""
    block_n = 2 if n // 2 >= 2 * sms else 1
    block_k = (32 if kind == ROW_SCALES else 16) * 32 * 4 // block_n
    if kind == ROW_SCALES:
        block_k = _step(k, block_k)
    return Config(block_n, block_k, 4, prefetch=k > block_k)


def supports_8bit(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, kind: int) -> bool:
    """Whether ``gemv_8bit`` takes these operands: one row of x (2 to 4 ran slower than the
    tiled quantized kernel: the CUDA cores' conversions and FMAs become the limit) with a unit
    stride along K, an int8 (``ROW_SCALES``: float32 scales ``[N, 1]``) or uint8
    (``FP8_BLOCKS``: float32 scales ``[ceil(N / 128), >= ceil(K / 128)]``) contiguous weight."""
    on_device = x2.is_cuda and qweight.is_cuda and x2.device == qweight.device == scales.device
    on_cpu = interpreting() and x2.device.type == qweight.device.type == scales.device.type == "cpu"
    if not ((on_device or on_cpu) and x2.dim() == 2 and qweight.dim() == 2 and x2.shape[0] == 1
            and x2.dtype in FLOAT_DTYPES and qweight.shape[1] == x2.shape[1] and qweight.is_contiguous()
            and (x2.shape[1] <= 1 or x2.stride(1) == 1) and scales.dtype == torch.float32 and scales.dim() == 2
            and scales.stride(1) == 1):
        return False
    n, k = qweight.shape
    if kind == ROW_SCALES:
        return qweight.dtype == torch.int8 and scales.shape[0] == n
    return (kind == FP8_BLOCKS and qweight.dtype == torch.uint8 and scales.shape[0] == -(-n // 128)
            and scales.shape[1] >= -(-k // 128))


def gemv_8bit(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, kind: int,
              bias: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """``x2 [1, K] @ dequantize(qweight [N, K]).T (+ bias)`` -> ``[1, N]`` in x's dtype for the
    8-bit weights ``supports_8bit`` accepts: the weight streamed as stored (half bf16's bytes),
    float8 values scaled in the loop, int8 sums once per output."""
    k = qweight.shape[1]
    n = qweight.shape[0]
    y = torch.empty((1, n), dtype=x2.dtype, device=x2.device)
    if n == 0:
        return y
    if k == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(1, n))
    if config is None:
        config = choose_config_8bit(n, k, kind, sm_count(x2.device, otherwise=132))
    bias = None if bias is None else bias.contiguous()
    if kind == ROW_SCALES:
        _launch(x2, qweight, scales, kind, bias, y, config)
        return y
    if config.block_k % 128:
        raise ValueError(f"gemv_8bit: float8 steps of {config.block_k} columns cut its 128-column blocks")
    _gemv_fp8_kernel[(triton.cdiv(n, config.block_n),)](
        x2, qweight, scales, qweight if bias is None else bias, y, n, k, qweight.stride(0), scales.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCKS=config.block_k // 128,
        EVEN_K=k % config.block_k == 0, PREFETCH=config.prefetch and k > config.block_k,
        num_warps=config.num_warps, num_stages=1, **pdl(x2.device))
    return y
