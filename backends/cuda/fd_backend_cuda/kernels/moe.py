"""The fused mixture-of-experts op: routed experts as two grouped GEMMs over the experts that
have tokens, for plain (float32, float16, bfloat16) and wint8 / wint4 / block_wise_fp8 experts.

``pack_experts`` stacks a layer's experts once at load: gate/up ``[E, 2I, H]`` and down
``[E, H, I]`` (quantized: each expert in ``pack_linear``'s layout, the ``qweight``, scales and
zeros stacked along a new first axis). ``moe`` then runs

1. the router (``fd_core.runtimes.torch.ops.route``: float32 scores, top-k with the lower id on
   ties, renormalisation) on the device;
2. ``align``: the (token, k) pairs sorted by expert and each expert's run padded to a multiple
   of ``BLOCK_M``, so that every block of ``BLOCK_M`` sorted slots belongs to one expert;
   built with device ops only (no count is read on the host), into buffers sized for the worst
   case, so that a decode step is capturable in a CUDA graph;
3. ``_gate_up_kernel``: per (block, column tile) the gate and the up tile of the block's expert
   against its tokens' rows, SiLU(gate) * up in the epilogue, stored per sorted slot;
4. ``_down_kernel``: per (block, column tile) the down projection of those rows, scaled by the
   pair's routing weight and stored at the pair's own row;
5. the combine: each token's ``top_k`` rows summed in float32.

Both GEMM kernels read the weight tile by tile through ``quantized_linear.weight_dot``, the
quantized linear's own step, so the formats are decoded in one place. Blocks past the padded
total (and, under expert parallelism, the slots of pairs whose expert is another rank's) exit
at once: the grid is the worst case for ``N x top_k`` pairs and costs nothing where empty.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from fd_core.interfaces import FP8_BLOCK, QuantizedWeight

from fd_backend_cuda.kernels.quantized_linear import (
    _CODES,
    _int4_chunk,
    _step,
    pack_linear,
    weight_dot,
)

Tensor = torch.Tensor
PLAIN = 3  # weight_dot's KIND for a plain matrix
PACKED_INT4 = _CODES["cuda_w4"]


@triton.jit
def _block(sorted_ptr, block_expert_ptr, N_PAIRS, BLOCK_M: tl.constexpr):
    """This program's block of sorted slots (grid axis 1): its expert (``NUM_EXPERTS`` or more
    past the padded total), the slots, the pairs in them and which of those are real."""
    block = tl.program_id(1)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + slots)
    return tl.load(block_expert_ptr + block), slots, pairs, pairs < N_PAIRS


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, a_ptr, sorted_ptr, block_expert_ptr,
    N_PAIRS, TOP_K, NUM_EXPERTS, I, H, GROUP,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_am,
    KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC_OFFSET: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, slots, pairs, m_ok = _block(sorted_ptr, block_expert_ptr, N_PAIRS, BLOCK_M)
    if e >= NUM_EXPERTS:  # past the padded total
        return
    pid_n = tl.program_id(0)
    x_rows = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_xm
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    gate = rn.to(tl.int64)
    up = gate + I
    w = w_ptr + e.to(tl.int64) * stride_we
    s = s_ptr + e.to(tl.int64) * stride_se
    z = z_ptr + e.to(tl.int64) * stride_se
    if KIND == 2:  # fp8: one scale row per 128 weight rows
        s_gate, s_up = s + (gate // 128) * stride_sn, s + (up // 128) * stride_sn
    else:
        s_gate, s_up = s + gate * stride_sn, s + up * stride_sn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc_gate = weight_dot(acc_gate, x_rows, m_ok, w + gate[:, None] * stride_wn, n_ok, s_gate,
                              z + gate * stride_sn, k0, H, GROUP, KIND, HAS_ZEROS, MAGIC_BITS, MAGIC_OFFSET,
                              BLOCK_N, BLOCK_K, PRECISION)
        acc_up = weight_dot(acc_up, x_rows, m_ok, w + up[:, None] * stride_wn, n_ok, s_up,
                            z + up * stride_sn, k0, H, GROUP, KIND, HAS_ZEROS, MAGIC_BITS, MAGIC_OFFSET,
                            BLOCK_N, BLOCK_K, PRECISION)
    act = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    out = a_ptr + slots.to(tl.int64)[:, None] * stride_am + rn[None, :]
    tl.store(out, act.to(a_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    a_ptr, w_ptr, s_ptr, z_ptr, y_ptr, sorted_ptr, block_expert_ptr, weights_ptr,
    N_PAIRS, NUM_EXPERTS, H, I, GROUP,
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    KIND: tl.constexpr, HAS_ZEROS: tl.constexpr, MAGIC_BITS: tl.constexpr, MAGIC_OFFSET: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    e, slots, pairs, m_ok = _block(sorted_ptr, block_expert_ptr, N_PAIRS, BLOCK_M)
    if e >= NUM_EXPERTS:
        return
    pid_n = tl.program_id(0)
    a_rows = a_ptr + slots.to(tl.int64)[:, None] * stride_am
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    rows = rn.to(tl.int64)
    w = w_ptr + e.to(tl.int64) * stride_we + rows[:, None] * stride_wn
    s = s_ptr + e.to(tl.int64) * stride_se
    z = z_ptr + e.to(tl.int64) * stride_se + rows * stride_sn
    s = s + ((rows // 128) if KIND == 2 else rows) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc = weight_dot(acc, a_rows, m_ok, w, n_ok, s, z, k0, I, GROUP, KIND, HAS_ZEROS, MAGIC_BITS,
                         MAGIC_OFFSET, BLOCK_N, BLOCK_K, PRECISION)
    acc *= tl.load(weights_ptr + pairs, mask=m_ok, other=0.0)[:, None]
    out = y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# --- packing --------------------------------------------------------------------------------------


def _stack(weights: list) -> Tensor | QuantizedWeight | None:
    """One layer's experts (one projection) as one stacked weight; None where the kernel does
    not read them (mixed methods, a group the int4 layout cannot chunk)."""
    if not isinstance(weights[0], QuantizedWeight):
        if any(isinstance(w, QuantizedWeight) for w in weights):
            return None
        return torch.stack(weights)
    if any(not isinstance(w, QuantizedWeight) or w.method != weights[0].method for w in weights):
        return None
    packed = [pack_linear(w) for w in weights]
    layout = packed[0].layout
    if layout not in _CODES:  # cuda_dense: dequantized bfloat16 copies, a plain stack (read in x's dtype)
        return torch.stack([p.qweight for p in packed])
    first = packed[0]
    return QuantizedWeight(
        first.method, torch.stack([p.qweight for p in packed]), torch.stack([p.scales for p in packed]),
        first.group_size, first.shape, None if first.zeros is None else torch.stack([p.zeros for p in packed]),
        layout)


def pack_experts(gate_up: list, down: list) -> tuple:
    """``(gate_up, down)`` stacked for the kernels, or the lists themselves (the reference
    ``moe`` then runs) where either cannot be."""
    stacked = _stack(gate_up), _stack(down)
    if any(s is None for s in stacked):
        return gate_up, down
    return stacked


# --- routing and alignment ------------------------------------------------------------------------


def block_m_for(pairs: int, experts: int) -> int:
    """Rows per block: as few as a tensor-core tile takes where experts get a handful of pairs
    (decode), more where each gets many (prefill)."""
    per_expert = pairs / max(experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64


def align(local_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """``(sorted_pairs, block_expert)`` for the pairs' local expert ids ``[N, top_k]`` (an id of
    ``num_experts`` or more: another rank's expert, dropped).

    ``sorted_pairs[b * block_m + i]`` is the flat pair index ``n * top_k + k`` of slot i of
    block b, or ``N * top_k`` in a pad slot; ``block_expert[b]`` is the expert of block b, or
    ``num_experts`` past the last one. Both are sized for the worst case of ``N * top_k``
    pairs, so the shapes depend on nothing but ``N``, ``top_k`` and ``num_experts``."""
    flat = local_ids.reshape(-1).clamp(max=num_experts)
    count = flat.numel()
    device = flat.device
    capacity = count + min(num_experts, count) * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.sort(flat, stable=True).indices
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    starts = torch.cat([ends - padded, ends.new_full((1,), capacity)])  # another rank's: past the end
    slot = starts[expert_of] + torch.arange(count, device=device) - first[expert_of]
    sorted_pairs = torch.full((capacity + 1,), count, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slot.clamp(max=capacity), order.to(torch.int32))
    blocks = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, blocks, right=True).to(torch.int32)
    return sorted_pairs[:capacity], block_expert


# --- the op ---------------------------------------------------------------------------------------


def _kind(weight: Tensor | QuantizedWeight) -> int:
    return _CODES[weight.layout] if isinstance(weight, QuantizedWeight) else PLAIN


def _operands(weight: Tensor | QuantizedWeight) -> tuple[Tensor, Tensor, Tensor, int, int, int, bool]:
    """``(qweight, scales, zeros, stride_expert, stride_row, group, has_zeros)`` as the kernels
    take them (a plain weight passes itself for the unused scales and zeros)."""
    if isinstance(weight, QuantizedWeight):
        s, z = weight.scales, weight.zeros
        return (weight.qweight, s, s if z is None else z, s.stride(0), s.stride(1), weight.group_size,
                z is not None)
    return weight, weight, weight, 0, 0, 1, False


def _step_k(weight: Tensor | QuantizedWeight, k: int, cap: int) -> int:
    """The K step: the int4 layout's chunk, fp8's block, else a power of two dividing the group."""
    if not isinstance(weight, QuantizedWeight):
        return min(cap, max(16, triton.next_power_of_2(k)))
    if weight.layout == "cuda_w4":
        return _int4_chunk(weight.group_size, k)  # type: ignore[return-value]
    if weight.layout == "cuda_fp8":
        return FP8_BLOCK
    return min(cap, _step(weight.group_size) or 16)


Config = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K cap, num_warps, num_stages


def _config(block_m: int, dtype: torch.dtype) -> Config:
    if dtype == torch.float32:  # twice the bytes a tile: small ones fit the shared memory
        return 32, 64, 4, 2
    return (64, 128, 4, 3) if block_m <= 32 else (128, 64, 8, 3)


def fused_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor | QuantizedWeight,
                  down: Tensor | QuantizedWeight, expert_offset: int = 0, total_experts: int | None = None,
                  config: Config | None = None) -> Tensor:
    """``sum_k weights[n, k] * down[e] @ silu_and_mul(gate_up[e] @ x[n])`` with ``e`` the local
    expert ``ids[n, k] - expert_offset``; pairs whose expert is not local add nothing.
    ``config`` overrides the tiles (benchmarks)."""
    n, hidden = x.shape
    top_k = ids.shape[1]
    num_experts = gate_up.qweight.shape[0] if isinstance(gate_up, QuantizedWeight) else gate_up.shape[0]
    inter = down.shape[1] if isinstance(down, QuantizedWeight) else down.shape[2]
    if n == 0:
        return x.new_zeros((0, hidden))
    kinds = _kind(gate_up), _kind(down)
    xd = x if x.stride(-1) == 1 else x.contiguous()
    local = ids - expert_offset
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    pairs = n * top_k
    block_m = block_m_for(pairs, num_experts)
    if x.dtype == torch.float32 or PACKED_INT4 in kinds:
        # float32 tiles take twice the bytes, int4's K step is its whole 256-column chunk:
        # 64-row blocks overflow the shared memory (measured on the H100)
        block_m = min(block_m, 32)
    sorted_pairs, block_expert = align(local, num_experts, block_m)
    blocks = block_expert.numel()
    block_n, k_cap, warps, stages = config or _config(block_m, x.dtype)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit operands
    bf16 = x.dtype == torch.bfloat16
    magic = {"MAGIC_BITS": 0x4300 if bf16 else 0x6400, "MAGIC_OFFSET": 136.0 if bf16 else 1032.0}
    act = torch.empty((blocks * block_m, inter), dtype=x.dtype, device=x.device)
    w, s, z, se, sn, group, zeros = _operands(gate_up)
    _gate_up_kernel[(triton.cdiv(inter, block_n), blocks)](
        xd, w, s, z, act, sorted_pairs, block_expert, pairs, top_k, num_experts, inter, hidden, group,
        xd.stride(0), w.stride(0), w.stride(1), se, sn, act.stride(0),
        KIND=kinds[0], HAS_ZEROS=zeros, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=_step_k(gate_up, hidden, k_cap), num_warps=warps, num_stages=stages, **magic)
    # every pair's row is written unless some experts are another rank's
    partial = total_experts is not None and total_experts > num_experts
    # float32: a token's top_k rows may nearly cancel, and rounding each to 16 bits first
    # would cost the sum its low bits (the kit's float16 case caught it)
    y = (torch.zeros if partial else torch.empty)((pairs, hidden), dtype=torch.float32, device=x.device)
    w, s, z, se, sn, group, zeros = _operands(down)
    _down_kernel[(triton.cdiv(hidden, block_n), blocks)](
        act, w, s, z, y, sorted_pairs, block_expert, weights.reshape(-1).float().contiguous(), pairs,
        num_experts, hidden, inter, group, act.stride(0), w.stride(0), w.stride(1), se, sn, y.stride(0),
        KIND=kinds[1], HAS_ZEROS=zeros, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=_step_k(down, inter, k_cap), num_warps=warps, num_stages=stages, **magic)
    return y.view(n, top_k, hidden).sum(dim=1).to(x.dtype)


def moe(x: Tensor, router_weight: Tensor, gate_up, down, top_k: int, scoring: str = "softmax",
        renormalize: bool = True, correction_bias: Tensor | None = None, expert_offset: int = 0) -> Tensor:
    from fd_core.runtimes.torch import ops as reference

    if isinstance(gate_up, list) or isinstance(down, list):  # pack_experts kept them: the reference
        return reference.moe(x, router_weight, gate_up, down, top_k, scoring, renormalize, correction_bias,
                             expert_offset)
    ids, weights = reference.route(x, router_weight, top_k, scoring, renormalize, correction_bias)
    return fused_experts(x, ids, weights, gate_up, down, expert_offset, router_weight.shape[0])
