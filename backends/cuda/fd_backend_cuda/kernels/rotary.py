"""Rotary position embedding over the first R dims of each head (R <= D, R even).

``cos_sin [P, R]`` holds ``concat(cos(p * inv_freq), sin(p * inv_freq))`` per position. Style
``"neox"`` rotates the pairs ``(i, i + R/2)``, ``"interleaved"`` the pairs ``(2i, 2i + 1)``; dims
``R..D`` pass through. Math in float32, results in the input's dtype.

By default the results are NEW tensors ``(q', k')`` (the contract returns them and the inputs are
left untouched); ``inplace=True`` rotates q and k where they lie (then the pass-through dims are
not touched at all) and returns them.

Design: grid ``(N, cdiv(Hq, BLOCK_H) + cdiv(Hk, BLOCK_H))``: a program takes one token and a
block of its query heads or of its key heads, loads that token's cos/sin row once and rotates
``[BLOCK_H, R/2]`` pairs. q and k may be strided views (e.g. slices of a fused qkv output); only
their last axis must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fd_backend_cuda.kernels._common import check_float, next_pow2, pdl, pdl_start

STYLES = ("neox", "interleaved")


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    cs_row,
    tok,
    head0,
    num_heads,
    x_sn,
    x_sh,
    o_sn,
    o_sh,
    half,
    head_dim,
    IS_NEOX: tl.constexpr,
    INPLACE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    heads = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    hmask = heads < num_heads
    x_head = x_ptr + tok * x_sn + heads * x_sh
    o_head = o_ptr + tok * o_sn + heads * o_sh
    rot = 2 * half
    if IS_NEOX:
        # neox: two contiguous halves, pairs (i, i + R/2)
        cos = tl.load(cs_row + i, mask=i < half, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + half + i, mask=i < half, other=0.0).to(tl.float32)
        mask = hmask[:, None] & (i < half)[None, :]
        a = tl.load(x_head[:, None] + i[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_head[:, None] + half + i[None, :], mask=mask, other=0.0).to(tl.float32)
        ra = a * cos[None, :] - b * sin[None, :]
        rb = b * cos[None, :] + a * sin[None, :]
        tl.store(o_head[:, None] + i[None, :], ra.to(o_ptr.dtype.element_ty), mask=mask)
        tl.store(
            o_head[:, None] + half + i[None, :],
            rb.to(o_ptr.dtype.element_ty),
            mask=mask,
        )
    else:
        # interleaved, pairs (2i, 2i + 1): the contiguous [BLOCK_H, R] span split into pairs in
        # registers. H200, bf16, 4096 tokens x 40 heads x 128: ~3 TB/s, as neox; two stride-2
        # accesses ran at 0.5 TB/s, a [.., R/2, 2] pointer tile split/joined at 0.85 TB/s.
        cos = tl.load(cs_row + i, mask=i < half, other=0.0).to(tl.float32)
        sin = tl.load(cs_row + half + i, mask=i < half, other=0.0).to(tl.float32)
        c = tl.arange(0, 2 * BLOCK_HALF)
        mask = hmask[:, None] & (c < rot)[None, :]
        x = tl.load(x_head[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
        a, b = tl.split(tl.reshape(x, [BLOCK_H, BLOCK_HALF, 2]))
        ra = a * cos[None, :] - b * sin[None, :]
        rb = b * cos[None, :] + a * sin[None, :]
        out = tl.reshape(tl.join(ra, rb), [BLOCK_H, 2 * BLOCK_HALF])
        tl.store(o_head[:, None] + c[None, :], out.to(o_ptr.dtype.element_ty), mask=mask)
    if not INPLACE and BLOCK_PASS > 0:
        p = rot + tl.arange(0, BLOCK_PASS)
        pmask = hmask[:, None] & (p < head_dim)[None, :]
        rest = tl.load(x_head[:, None] + p[None, :], mask=pmask, other=0.0)
        tl.store(o_head[:, None] + p[None, :], rest.to(o_ptr.dtype.element_ty), mask=pmask)


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
    half,
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
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_start(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cs_row = cs_ptr + pos * cs_stride
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if hb < num_q_blocks:
        _rotate_heads(
            q_ptr, qo_ptr, cs_row, tok, hb * BLOCK_H, num_q_heads, q_sn, q_sh, qo_sn, qo_sh,
            half, head_dim, IS_NEOX, INPLACE, BLOCK_H, BLOCK_HALF, BLOCK_PASS,
        )  # fmt: skip
    else:
        _rotate_heads(
            k_ptr, ko_ptr, cs_row, tok, (hb - num_q_blocks) * BLOCK_H, num_k_heads, k_sn, k_sh,
            ko_sn, ko_sh, half, head_dim, IS_NEOX, INPLACE, BLOCK_H, BLOCK_HALF, BLOCK_PASS,
        )  # fmt: skip


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
    if style not in STYLES:
        raise ValueError(f"unknown rotary style {style!r}")
    tokens = positions.shape[0]
    if not inplace:
        q = q if q.shape[-1] <= 1 or q.stride(-1) == 1 else q.contiguous()
        k = k if k.shape[-1] <= 1 or k.stride(-1) == 1 else k.contiguous()
    _check_heads("q", q, tokens)
    _check_heads("k", k, tokens)
    check_float("rotary cos_sin", cos_sin)
    head_dim = q.shape[-1]
    rot = cos_sin.shape[-1]
    if k.shape[-1] != head_dim or rot % 2 or rot > head_dim or rot == 0:
        raise ValueError(f"rotary: need even R <= D, got R={rot}, D={head_dim}, k D={k.shape[-1]}")
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    half = rot // 2
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return qo, ko
    positions = positions if positions.is_contiguous() else positions.contiguous()
    num_q, num_k = q.shape[1], k.shape[1]
    block_half = next_pow2(half)
    block_pass = next_pow2(head_dim - rot) if head_dim > rot else 0
    # About 2K pairs per program: a whole token's heads for small models.
    block_h = max(1, min(next_pow2(max(num_q, num_k)), max(1, 2048 // block_half)))
    grid = (tokens, triton.cdiv(num_q, block_h) + triton.cdiv(num_k, block_h))
    _rotary_kernel[grid](
        positions,
        cos_sin,
        q,
        k,
        qo,
        ko,
        num_q,
        num_k,
        head_dim,
        half,
        cos_sin.stride(0),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        qo.stride(0),
        qo.stride(1),
        ko.stride(0),
        ko.stride(1),
        IS_NEOX=style == "neox",
        INPLACE=inplace,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        BLOCK_PASS=block_pass,
        num_warps=4 if block_h * block_half >= 1024 else 2,
        **pdl(q.device),
    )
    return qo, ko
