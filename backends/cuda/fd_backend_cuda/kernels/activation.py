"""SwiGLU activation: ``silu(x[:, :I]) * x[:, I:]`` (the gate is the first half).

Math in float32 (``silu(g) = g / (1 + exp(-g))``), result in x's dtype, a new ``[N, I]`` tensor.

Design: grid ``(N, cdiv(I, BLOCK))``, one program per row and ``BLOCK`` output columns (up to
1024; 4 warps). Pure bandwidth: each element of x is read once, each output written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fd_backend_cuda.kernels._common import check_float, next_pow2, pdl, pdl_start, rows_2d

MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, o_ptr, inter, x_stride, o_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * x_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(o_ptr + row * o_stride + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I] -> [..., I]``."""
    check_float("silu_and_mul x", x)
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"silu_and_mul: last dim {width} is odd")
    inter = width // 2
    x2 = rows_2d(x)
    rows = x2.shape[0]
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows and inter:
        block = min(next_pow2(inter), MAX_BLOCK)
        grid = (rows, triton.cdiv(inter, block))
        _silu_and_mul_kernel[grid](
            x2,
            out,
            inter,
            x2.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4 if block >= 512 else 2,
            **pdl(x.device),
        )
    return out.reshape(*x.shape[:-1], inter)
