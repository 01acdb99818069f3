"""Rotary position embedding over the first R dims of each head (R <= D, R even).

``cos_sin [P, R]`` holds ``concat(cos(p * inv_freq), sin(p * inv_freq))`` per position. Style
``"neox"`` rotates the pairs ``(i, i + R/2)``, ``"interleaved"`` the pairs ``(2i, 2i + 1)``; dims
``R..D`` pass through. Math in float32, results in the input's dtype.

By default the results are NEW tensors ``(q', k')`` (the contract returns them and the inputs are
left untouched); ``inplace=True`` rotates q and k where they lie (then the pass-through dims are
not touched at all) and returns them.

Design: grid ``(N, cdiv(Hq, BLOCK_H) + cdiv(Hk, BLOCK_H))``: a program takes one token and a
block of its query heads or of its key heads and rotates their ``[BLOCK_H, D]`` rows with
``rotated``, which loads each row and, a second time, its pair partners (coalesced, from L1)
rather than splitting pairs in registers. The same ``rotated`` is attention's K/V write's for
``rotary_attention``, so the fused op rotates exactly as this op does. q and k may be strided
views (e.g. slices of a fused qkv output); only their last axis must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fd_backend_cuda.kernels._common import check_float, next_pow2, pdl, pdl_start

STYLES = ("neox", "interleaved")


def check_table(style: str, rot: int, head_dim: int) -> None:
    """Refuse a style or a table width (R) this module cannot rotate heads of ``head_dim`` with."""
    if style not in STYLES:
        raise ValueError(f"unknown rotary style {style!r}")
    if rot % 2 or rot == 0 or rot > head_dim:
        raise ValueError(f"rotary: need even R <= D, got R={rot}, D={head_dim}")


@triton.jit
def rotated(x_ptr, rows, d, mask, cs_row, rot, IS_NEOX: tl.constexpr):
    """The ``[H, D]`` rows at ``x_ptr + rows`` (each head's first element) rotated, float32:
    element ``d`` pairs with ``d +- R/2`` (neox) or ``d ^ 1`` (interleaved), whose value a
    second load of the same rows gathers; dims from ``R`` on pass through. The one rotation of
    the ``rotary`` op and of attention's K/V write (``rotary_attention``)."""
    x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    half = rot // 2
    if IS_NEOX:
        first = d < half
        partner = tl.where(first, d + half, d - half)
        angle = tl.where(first, d, d - half)
    else:
        first = d % 2 == 0
        partner = d ^ 1
        angle = d // 2
    turning = d < rot
    other = tl.load(x_ptr + rows[:, None] + partner[None, :], mask=mask & turning[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cs_row + angle, mask=turning, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + half + angle, mask=turning, other=0.0).to(tl.float32)
    xc = x * cos[None, :]
    os = other * sin[None, :]
    return tl.where(first[None, :], xc - os, xc + os)


@triton.jit
def rotate_heads(x_ptr, o_ptr, tok, heads, num_heads, x_sn, x_sh, o_sn, o_sh, d, head_dim, cs_row, rot,
                 IS_NEOX: tl.constexpr, ONLY_ROTATED: tl.constexpr):
    """Token ``tok``'s ``heads`` of x rotated into o (``ONLY_ROTATED``: the first R dims only,
    for rotating in place)."""
    mask = (heads < num_heads)[:, None] & (d < head_dim)[None, :]
    x = rotated(x_ptr, tok * x_sn + heads * x_sh, d, mask, cs_row, rot, IS_NEOX)
    if ONLY_ROTATED:
        mask = mask & (d < rot)[None, :]
    out = o_ptr + tok * o_sn + heads * o_sh
    tl.store(out[:, None] + d[None, :], x.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    cs_ptr,
    q_ptr,
    k_ptr,
    qo_ptr,
    ko_ptr,
    num_q_heads,
    num_k_heads,
    head_dim,
    rot,
    cs_stride,
    q_sn,
    q_sh,
    k_sn,
    k_sh,
    qo_sn,
    qo_sh,
    ko_sn,
    ko_sh,
    IS_NEOX: tl.constexpr,
    INPLACE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    cs_row = cs_ptr + tl.load(pos_ptr + tok).to(tl.int64) * cs_stride
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if hb < q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        rotate_heads(q_ptr, qo_ptr, tok, heads, num_q_heads, q_sn, q_sh, qo_sn, qo_sh, d, head_dim, cs_row,
                     rot, IS_NEOX, INPLACE)
    else:
        heads = (hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        rotate_heads(k_ptr, ko_ptr, tok, heads, num_k_heads, k_sn, k_sh, ko_sn, ko_sh, d, head_dim, cs_row,
                     rot, IS_NEOX, INPLACE)


def _check_heads(name: str, x: torch.Tensor, tokens: int) -> None:
    check_float(f"rotary {name}", x)
    if x.dim() != 3 or x.shape[0] != tokens:
        raise ValueError(
            f"rotary: {name} must be [N, heads, D] with N={tokens}, got {tuple(x.shape)}"
        )
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"rotary: {name} needs a contiguous last axis")


def rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    style: str,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [N, Hq, D]`` and ``k [N, Hk, D]`` at ``positions [N]``; see the module doc."""
    tokens = positions.shape[0]
    if not inplace:
        q = q if q.shape[-1] <= 1 or q.stride(-1) == 1 else q.contiguous()
        k = k if k.shape[-1] <= 1 or k.stride(-1) == 1 else k.contiguous()
    _check_heads("q", q, tokens)
    _check_heads("k", k, tokens)
    check_float("rotary cos_sin", cos_sin)
    head_dim = q.shape[-1]
    rot = cos_sin.shape[-1]
    check_table(style, rot, head_dim)
    if k.shape[-1] != head_dim:
        raise ValueError(f"rotary: q and k heads differ in size, {head_dim} and {k.shape[-1]}")
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return qo, ko
    positions = positions if positions.is_contiguous() else positions.contiguous()
    num_q, num_k = q.shape[1], k.shape[1]
    block_d = next_pow2(head_dim)
    # a whole token's heads a program for small models, at most 4K elements
    block_h = max(1, min(next_pow2(max(num_q, num_k)), max(1, 4096 // block_d)))
    grid = (tokens, triton.cdiv(num_q, block_h) + triton.cdiv(num_k, block_h))
    _rotary_kernel[grid](
        positions, cos_sin, q, k, qo, ko, num_q, num_k, head_dim, rot, cos_sin.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        IS_NEOX=style == "neox",
        INPLACE=inplace,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2,
        **pdl(q.device),
    )  # fmt: skip
    return qo, ko
