"""Weight-only quantized ``linear``: ``y = x @ dequantize(w).T + bias`` reading 8-bit, 4-bit or
FP8 weights straight from HBM, never a dequantized copy; on sm90, ``block_wise_fp8`` from
``W8A8_MIN_ROWS`` rows as W8A8 instead (FP8 activations, ``w8a8_linear`` below).

Layouts made once at load by ``pack_linear`` (the contract's ``QuantizedWeight.layout``):

- ``cuda_w8``: wint8, ``qweight`` int8 ``[out, in]`` as the canonical form;
- ``cuda_w4``: wint4, two values per byte (``[out, in / 2]`` uint8, stored as ``q + 8``): ``in``
  cut into chunks of ``2 h`` columns (``h`` up to 128, dividing the group), byte ``i`` of a chunk
  holding its column ``i`` in the low nibble and ``h + i`` in the high one, so one step reads
  ``h`` bytes a row and two contiguous runs of ``x``: half the bytes of int8;
- ``cuda_fp8``: block_wise_fp8, ``qweight`` the e4m3fn bits as uint8 (read as float8 in the kernel);
- ``cuda_dense``: anything the kernel does not take (a group size with no power-of-two factor
  of at least 16), dequantized once to the activations' dtype and run through cuBLAS.

Scales (and zeros) stay ``[out, groups]`` float32 (fp8: ``[ceil(out/128), ceil(in/128)]``).

Design: one program per ``BLOCK_M x BLOCK_N`` output tile loops over ``in`` in ``BLOCK_K``
steps, ``BLOCK_K`` a power of two dividing the group (fp8: the 128-column block), so one scale
(and zero) per output column covers the step: the raw integers (exact in bf16/fp16) go through
``tl.dot`` and the step's partial sum is scaled after it, ``acc += dot(x, q) * s + rowsum(x) * z``.
Decode batches (``M <= 16``) use narrow ``BLOCK_N`` tiles so that at least two programs run per
SM: the loop streams the weight once at full bandwidth without a split-K reduction, and with no
workspace the kernel is safe inside CUDA graphs. Prefill uses 128 x 128 tiles. At one row (a
16-row tile would be 15 rows of padding) wint8 per channel and block_wise_fp8 go to
``gemv.py``'s one-row kernels, wint4 at one row to ``int4_row.py`` (Gluon, sm80-sm90) and at two to
four rows (or where Gluon is missing) to ``int4_gemv.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from fd_core.interfaces import FP8_BLOCK, QuantizedWeight

from fd_backend_cuda.kernels import gemv, int4_gemv, int4_row
from fd_backend_cuda.kernels._common import capability, sm_count

METHODS = ("wint8", "wint4", "block_wise_fp8")
_CODES = {"cuda_w8": 0, "cuda_w4": 1, "cuda_fp8": 2}
_DOT_DTYPES = (torch.float16, torch.bfloat16)
# Above this many rows the product is compute-bound: one pass that dequantizes the weight to the
# activations' dtype, then cuBLAS, beats dequantizing in every tile (measured, see the README).
FUSED_MAX_ROWS = 128
# wint4's tiles unpack twice the values per byte: its copy-then-cuBLAS path wins sooner (at 128
# rows by 1.5-2x on Llama-3-8B's shapes, break-even near 64 by the same figures)
FUSED_MAX_ROWS_INT4 = 64


@triton.jit
def weight_dot(acc, x_rows, m_ok, w_rows, n_ok, s_rows, z_rows, k0, K, GROUP,
               KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC_OFFSET: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """``acc`` plus one K step, columns ``k0 .. k0 + BLOCK_K``, of ``x @ dequantize(w).T``.

    ``x_rows`` / ``w_rows``: pointers to the rows' starts (``[BLOCK_M, 1]`` / ``[BLOCK_N, 1]``),
    ``s_rows`` / ``z_rows``: to each output row's scales / zeros (``[BLOCK_N]``; fp8: the row's
    128-row block). ``KIND``: 0 int8, 1 packed int4, 2 fp8 bits, 3 a plain matrix (converted to
    x's dtype). ``PRECISION``: "ieee" for float32 ``x`` (exact products), ignored for 16-bit.
    Shared by the quantized ``linear`` and the fused ``moe`` (``kernels/moe.py``)."""
    x_dtype = x_rows.dtype.element_ty
    if KIND == 1:
        # one step is a chunk of BLOCK_K columns: byte i of it holds column i (low nibble)
        # and column BLOCK_K / 2 + i (high), each half within one group
        rh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_rows + rh[None, :], mask=n_ok[:, None], other=0x88)
        r_low = k0 + tl.arange(0, BLOCK_K // 2)
        x_low = tl.load(x_rows + r_low[None, :], mask=m_ok[:, None], other=0.0)
        x_high = tl.load(x_rows + BLOCK_K // 2 + r_low[None, :], mask=m_ok[:, None], other=0.0)
        s_low = tl.load(s_rows + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        s_high = tl.load(s_rows + (k0 + BLOCK_K // 2) // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        if x_dtype == tl.float32:
            # exact float32 (the oracle's dtype): the magic offset below would cancel away
            # float32 operands' low bits, so the values are converted outright
            low = ((packed & 0xF).to(tl.int16) - 8).to(tl.float32)
            high = ((packed >> 4).to(tl.int16) - 8).to(tl.float32)
            acc += tl.dot(x_low, tl.trans(low), input_precision=PRECISION) * s_low[None, :]
            acc += tl.dot(x_high, tl.trans(high), input_precision=PRECISION) * s_high[None, :]
            if HAS_ZEROS:
                sum_low = tl.sum(x_low, axis=1)[:, None]
                sum_high = tl.sum(x_high, axis=1)[:, None]
        else:
            # u = q + 8 in [0, 15] OR-ed into the mantissa of MAGIC (bf16 128, fp16 1024) is the
            # float MAGIC + u exactly, with no int-to-float conversion; the dot's excess,
            # (MAGIC + 8) * sum(x), is taken off after it
            low = ((packed & 0xF).to(tl.int16) | MAGIC_BITS).to(x_dtype, bitcast=True)
            high = ((packed >> 4).to(tl.int16) | MAGIC_BITS).to(x_dtype, bitcast=True)
            # sum(x) broadcast over the output columns through the tensor cores (a dot with
            # ones), not a cross-thread reduction per step
            ones = tl.full((BLOCK_K // 2, BLOCK_N), 1.0, x_dtype)
            sum_low = tl.dot(x_low, ones)
            sum_high = tl.dot(x_high, ones)
            acc += (tl.dot(x_low, tl.trans(low)) - MAGIC_OFFSET * sum_low) * s_low[None, :]
            acc += (tl.dot(x_high, tl.trans(high)) - MAGIC_OFFSET * sum_high) * s_high[None, :]
        if HAS_ZEROS:  # x . (q s + z) = (x . q) s + (sum x) z over each group's columns
            acc += sum_low * tl.load(z_rows + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc += sum_high * tl.load(z_rows + (k0 + BLOCK_K // 2) // GROUP, mask=n_ok,
                                     other=0.0).to(tl.float32)[None, :]
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        if KIND == 2:  # uint8 bits: a masked lane reads 0, never a NaN pattern
            q = q.to(tl.float8e4nv, bitcast=True)
        part = tl.dot(x, tl.trans(q.to(x_dtype)), input_precision=PRECISION)
        if KIND == 3:
            acc += part
        else:
            # one scale per group (fp8: per 128 x 128 block, GROUP being 128)
            acc += part * tl.load(s_rows + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_ZEROS:  # x . (q s + z) = (x . q) s + (sum x) z over the group's columns
                z = tl.load(z_rows + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * z[None, :]
    return acc


def weight_dot_constants(dtype: torch.dtype) -> dict:
    """``weight_dot``'s dtype-bound constants for activations of ``dtype``: the int4 magic
    number's bits and the offset to take off (bf16 128 + 8, fp16 1024 + 8), and "ieee" products
    for float32 (tf32 is ignored for 16-bit operands)."""
    bf16 = dtype == torch.bfloat16
    return {"MAGIC_BITS": 0x4300 if bf16 else 0x6400, "MAGIC_OFFSET": 136.0 if bf16 else 1032.0,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


@triton.jit
def _quantized_linear_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr,
    M, N, K, GROUP, K_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    MAGIC_BITS: tl.constexpr, MAGIC_OFFSET: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + ((rn // 128) if KIND == 2 else rn).to(tl.int64) * stride_sn
    z_rows = z_ptr + rn.to(tl.int64) * stride_sn
    k_begin = pid_k * K_SPLIT
    k_end = tl.minimum(k_begin + K_SPLIT, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = weight_dot(acc, x_rows, m_ok, w_rows, n_ok, s_rows, z_rows, k0, K, GROUP, KIND, HAS_ZEROS,
                         MAGIC_BITS, MAGIC_OFFSET, BLOCK_N, BLOCK_K, PRECISION)
    if HAS_BIAS:
        if pid_k == 0:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    if ATOMIC:  # split K: float32 partial sums into a zeroed output
        tl.atomic_add(out, acc, mask=m_ok[:, None] & n_ok[None, :], sem="relaxed")
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, o_ptr, N, K, GROUP, stride_wn, stride_sn,
                       KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``BLOCK_K`` output columns per program (int4: one chunk of the packed layout)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = rn.to(tl.int64)[:, None]
    n_ok = (rn < N)[:, None]
    if KIND == 1:  # one chunk of BLOCK_K columns per program (the packed layout's chunk)
        rh = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_ptr + rows * stride_wn + rh[None, :], mask=n_ok, other=0x88)
        r_low = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K // 2)
        for half in tl.static_range(2):
            c0 = tl.program_id(1) * BLOCK_K + half * (BLOCK_K // 2)  # each half lies in one group
            w = (((byte >> (4 * half)) & 0xF).to(tl.int8) - 8).to(tl.float32)
            w = w * tl.load(s_ptr + rows * stride_sn + c0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                w += tl.load(z_ptr + rows * stride_sn + c0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            rk = r_low + half * (BLOCK_K // 2)
            tl.store(o_ptr + rows * K + rk[None, :], w.to(o_ptr.dtype.element_ty), mask=n_ok)
    else:
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = n_ok & (rk < K)[None, :]
        q = tl.load(w_ptr + rows * stride_wn + rk[None, :], mask=ok, other=0)
        if KIND == 2:
            q = q.to(tl.float8e4nv, bitcast=True)
            s = tl.load(s_ptr + (rn // 128).to(tl.int64)[:, None] * stride_sn + (rk // 128)[None, :], mask=ok,
                        other=0.0)
        else:
            s = tl.load(s_ptr + rows * stride_sn + (rk // GROUP)[None, :], mask=ok, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * s
        if HAS_ZEROS:
            w += tl.load(z_ptr + rows * stride_sn + (rk // GROUP)[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(o_ptr + rows * K + rk[None, :], w.to(o_ptr.dtype.element_ty), mask=ok)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """A packed weight (``cuda_w8``/``cuda_w4``/``cuda_fp8``) as a dense ``[out, in]`` matrix."""
    out_features, in_features = weight.shape
    out = torch.empty((out_features, in_features), dtype=dtype, device=weight.qweight.device)
    kind = _CODES[weight.layout]
    block_k = _int4_chunk(weight.group_size, in_features) if kind == 1 else 256
    grid = (triton.cdiv(out_features, 32), triton.cdiv(in_features, block_k))
    _dequantize_kernel[grid](weight.qweight, weight.scales, weight.scales if weight.zeros is None else weight.zeros,
                             out, out_features, in_features, weight.group_size, weight.qweight.stride(0),
                             weight.scales.stride(0), KIND=kind, HAS_ZEROS=weight.zeros is not None,
                             BLOCK_N=32, BLOCK_K=block_k, num_warps=4)
    return out


def _step(group: int) -> int | None:
    """The widest power-of-two K step (16..512) dividing ``group``; None if none does."""
    for step in (512, 256, 128, 64, 32, 16):
        if group % step == 0:
            return step
    return None


def _int4_chunk(group: int, in_features: int) -> int | None:
    """The columns one int4 step covers (two halves, each within one group): twice the widest
    power of two from 16 to 128 that divides the group, such that the chunks tile ``in``."""
    for half in (128, 64, 32, 16):
        if group % half == 0 and in_features % (2 * half) == 0:
            return 2 * half
    return None


# cuda_w4 keeps wint4's scales and zeros in bfloat16, as the contract allows a quantized linear
# (spec's QUANTIZED_LINEAR_TOLERANCE): at group 128 float32 ones were 1/8 of the bytes a one-row
# decode streams (8B shape, H200: 2.358 -> 2.236 ms a token); the kernels apply them in float32
W4_SCALES = torch.bfloat16


def kept(weight: QuantizedWeight) -> QuantizedWeight:
    """``weight`` (canonical; torch or NumPy fields) with its scales and zeros rounded as
    ``pack_linear`` keeps them, still canonical: the weight the kernels compute with, for an
    exact reference."""
    if weight.method != "wint4":
        return weight

    def rounded(t):
        if t is None:
            return None
        if isinstance(t, torch.Tensor):
            return t.to(W4_SCALES).to(t.dtype)
        return torch.from_numpy(t).to(W4_SCALES).to(torch.float32).numpy().astype(t.dtype)

    return dataclasses.replace(weight, scales=rounded(weight.scales), zeros=rounded(weight.zeros))


def pack_linear(weight: QuantizedWeight) -> QuantizedWeight:
    out_features, in_features = weight.shape
    group = in_features if weight.group_size == -1 else weight.group_size
    step = FP8_BLOCK if weight.method == "block_wise_fp8" else _step(group)
    chunk = _int4_chunk(group, in_features) if weight.method == "wint4" else None
    if chunk is not None:
        u = (weight.qweight.to(torch.int16) + 8).to(torch.uint8).reshape(out_features, -1, 2, chunk // 2)
        packed = (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(out_features, in_features // 2).contiguous()
        if packed.is_cuda:
            int4_gemv.reserve(packed.device, out_features)
        return QuantizedWeight("wint4", packed, weight.scales.to(W4_SCALES).contiguous(), group, weight.shape,
                               None if weight.zeros is None else weight.zeros.to(W4_SCALES).contiguous(), "cuda_w4")
    if weight.method == "wint8" and step is not None:
        return QuantizedWeight("wint8", weight.qweight.contiguous(), weight.scales.float().contiguous(), group,
                               weight.shape, None if weight.zeros is None else weight.zeros.float().contiguous(),
                               "cuda_w8")
    if weight.method == "block_wise_fp8":
        bits = weight.qweight if weight.qweight.dtype == torch.uint8 else weight.qweight.view(torch.uint8)
        # scales padded to a multiple of 4 blocks along K (zeros), as cuBLAS's 128 x 128 recipe reads them
        scales = weight.scales.float()
        padded = torch.zeros((scales.shape[0], -(-scales.shape[1] // 4) * 4), dtype=torch.float32,
                             device=scales.device)
        padded[:, : scales.shape[1]] = scales
        return QuantizedWeight("block_wise_fp8", bits.contiguous(), padded, FP8_BLOCK, weight.shape, None,
                               "cuda_fp8")
    from fd_core.runtimes.torch.ops import dequantize

    # kept in bfloat16: the activations' dtype is not known here; linear casts if it differs
    return QuantizedWeight(weight.method, dequantize(weight, torch.bfloat16).contiguous(), weight.scales,
                           weight.group_size, weight.shape, None, "cuda_dense")


# --- FP8 activations (W8A8) for block_wise_fp8 on sm90 -------------------------------------------
# FastDeploy's block_wise_fp8 (and DeepSeek-V3's recipe): activations quantized to e4m3 per
# (row, 128 columns) with scale max|x| / 448, the product on FP8 tensor cores with the weight's
# 128 x 128 block scales (cuBLAS through torch._scaled_mm, CUDA >= 12.9, sm90 only).
W8A8_MIN_ROWS = 16


@triton.jit
def _fp8_rows_kernel(x_ptr, q_ptr, s_ptr, M, M_PAD, K, stride_x, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Rows ``pid(0) * BLOCK_M ..``, columns ``pid(1) * BLOCK ..``: e4m3 values and their float32
    scales, the scales column-major ``[K / BLOCK, M_PAD]`` as cuBLAS's 1 x 128 recipe reads them.
    (One row per program, the first version, took as long as the GEMM on the down projection:
    279 against 383 us at 4,096 rows; 32 rows a program, 65 us.)"""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    r64 = rows.to(tl.int64)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + r64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
    safe = tl.where(scale == 0, 1.0, scale)
    q = tl.clamp(tl.math.div_rn(x, safe[:, None]), -448.0, 448.0).to(tl.float8e4nv)
    pad_ok = (rows < M_PAD)[:, None] & (cols < K)[None, :]
    tl.store(q_ptr + r64[:, None] * K + cols[None, :], q, mask=pad_ok)
    tl.store(s_ptr + g.to(tl.int64) * M_PAD + rows, scale, mask=rows < M_PAD)


def fp8_rows(x2: torch.Tensor, block_m: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2`` ``[M, K]`` as e4m3 ``[M_pad, K]`` and scales ``[M_pad, K / 128]`` (outer-dim-major),
    ``M_pad`` the next multiple of 4 (cuBLAS); pad rows are zero."""
    m, k = x2.shape
    m_pad = -(-m // 4) * 4
    q = torch.empty((m_pad, k), dtype=torch.float8_e4m3fn, device=x2.device)
    scales = torch.empty((k // FP8_BLOCK, m_pad), dtype=torch.float32, device=x2.device)
    _fp8_rows_kernel[(triton.cdiv(m_pad, block_m), k // FP8_BLOCK)](
        x2, q, scales, m, m_pad, k, x2.stride(0), BLOCK_M=block_m, BLOCK=FP8_BLOCK, num_warps=4)
    return q, scales.t()


def _w8a8_ready(weight: QuantizedWeight, x: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    # in: whole groups of 4 blocks (cuBLAS refused 3 blocks with the scales' rows padded to 4;
    # every model's widths here are multiples of 512)
    return (weight.layout == "cuda_fp8" and x.dtype in _DOT_DTYPES and in_features % (4 * FP8_BLOCK) == 0
            and out_features % FP8_BLOCK == 0 and _sm90(x.device))


def _sm90(device: torch.device) -> bool:
    return capability(device) == (9, 0)


def w8a8_linear(x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``x2 @ w.T`` with ``x2`` quantized per (row, 128 columns): ``[M, out]`` in ``x2``'s dtype."""
    out_features, in_features = weight.shape
    q, scale_a = fp8_rows(x2)
    groups = in_features // FP8_BLOCK
    # the weight's block scales read K-major, [in / 128, out / 128] with unit stride along K;
    # the rows padded to 4 blocks keep the other stride 16-byte aligned
    scale_b = weight.scales[:, :groups].t()
    w = weight.qweight.view(torch.float8_e4m3fn).t()
    y = torch._scaled_mm(q, w, scale_a=scale_a, scale_b=scale_b, out_dtype=x2.dtype)
    return y[: x2.shape[0]]


Config = tuple[int, int, int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages


def _config(m: int, n: int, k: int, step: int, sms: int, int4: bool) -> Config:
    """Tiles for an ``m x n`` output over ``k``; ``step`` is the widest K step the groups allow.
    Chosen from the sweep in benchmarks/bench_quantized_linear.py (H100, Llama-3-8B's shapes)."""
    if int4:  # the step is the packed layout's chunk, whatever the rows
        if m > 16:
            return 32, 64, step, 1, 4, 3
        block_k = step
    elif m > 16:
        return (64 if m <= 64 else 128), 64, min(step, 128), 1, 4, 3
    else:
        block_k = min(step, 256)
    block_n = 64
    split = 1
    # at least two programs per SM: split K across programs (float32 partial sums)
    while triton.cdiv(n, block_n) * split < 2 * sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return 16, block_n, block_k, split, 4, 3


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
           config: Config | None = None) -> torch.Tensor:
    """``config`` overrides the tile choice (the tile sweep in benchmarks/)."""
    if weight.layout == "cuda_dense":
        w = weight.qweight if weight.qweight.dtype == x.dtype else weight.qweight.to(x.dtype)
        return torch.nn.functional.linear(x, w, None if bias is None else bias.to(x.dtype))
    kind = _CODES.get(weight.layout)
    if kind is None:  # the canonical form: no pack_linear ran
        from fd_core.runtimes.torch.ops import linear as reference_linear

        return reference_linear(x, weight, bias)
    out_features, in_features = weight.shape
    shape = x.shape
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dot_x = x2  # float32 too: the weight's integers are exact in float32, the products "ieee"
    m = x2.shape[0]
    if not m:
        return x.new_empty((*shape[:-1], out_features))
    step = FP8_BLOCK if kind == 2 else _int4_chunk(weight.group_size, in_features) if kind == 1 else _step(weight.group_size)
    if config is None and kind == 1 and int4_gemv.supports(x2, weight, step // 2):  # one to four rows
        few = int4_row.int4_row if int4_row.supports(x2, weight, step // 2) else int4_gemv.int4_gemv
        y = few(x2, weight, step // 2, sm_count(x.device))
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], out_features)
    if config is None and m == 1 and weight.zeros is None:
        # 8-bit weights at one row: the plain few-row kernels, no 16-row tile of which 15 are
        # padding (docs/PERFORMANCE.md)
        per_channel = kind == 0 and weight.group_size in (-1, in_features)
        scaled = gemv.FP8_BLOCKS if kind == 2 else gemv.ROW_SCALES if per_channel else None
        if scaled is not None and gemv.supports_8bit(x2, weight.qweight, weight.scales, scaled):
            y = gemv.gemv_8bit(x2, weight.qweight, weight.scales, scaled, bias)
            return y.reshape(*shape[:-1], out_features)
    if config is None and m >= W8A8_MIN_ROWS and _w8a8_ready(weight, x2):
        y = w8a8_linear(x2, weight)
        if bias is not None:
            y = y + bias.to(y.dtype)
        return y.reshape(*shape[:-1], out_features)
    if config is None and m > (FUSED_MAX_ROWS_INT4 if kind == 1 else FUSED_MAX_ROWS):
        # compute-bound: cuBLAS on a dense copy made in one pass
        dense = dequantize(weight, dot_x.dtype)
        y = torch.nn.functional.linear(dot_x, dense, None if bias is None else bias.to(dot_x.dtype))
        return y.to(x.dtype).reshape(*shape[:-1], out_features)
    block_m, block_n, block_k, split, warps, stages = config or _config(m, out_features, in_features, step,
                                                                         sm_count(x.device), kind == 1)
    if kind == 1:
        block_k = step  # the int4 layout's chunk: the kernel reads the weight in exactly these
    k_split = triton.cdiv(triton.cdiv(in_features, split), block_k) * block_k
    atomic = split > 1
    y = (torch.zeros if atomic else torch.empty)((m, out_features), dtype=torch.float32 if atomic else x.dtype,
                                                 device=x.device)
    scales, zeros = weight.scales, weight.zeros
    grid = (triton.cdiv(out_features, block_n), triton.cdiv(m, block_m), triton.cdiv(in_features, k_split))
    _quantized_linear_kernel[grid](
        dot_x, weight.qweight, scales, scales if zeros is None else zeros, scales if bias is None else bias, y,
        m, out_features, in_features, weight.group_size, k_split,
        dot_x.stride(0), weight.qweight.stride(0), scales.stride(0), y.stride(0),
        KIND=kind, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None, ATOMIC=atomic,
        **weight_dot_constants(dot_x.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    if atomic:
        y = y.to(x.dtype)
    return y.reshape(*shape[:-1], out_features)
