"""The fused mixture-of-experts op: routed experts as two grouped GEMMs over the experts that
have tokens, for plain (float32, float16, bfloat16) and wint8 / wint4 / block_wise_fp8 experts.

``pack_experts`` stacks a layer's experts once at load: gate/up ``[E, 2I, H]`` and down
``[E, H, I]`` (quantized: each expert in ``pack_linear``'s layout, the ``qweight``, scales and
zeros stacked along a new first axis). ``moe`` then runs

1. the router: float32 logits (cuBLAS), then scores, top-k with the lower id on ties and
   renormalisation;
2. the alignment: the (token, k) pairs sorted by expert and each expert's run padded to a
   multiple of ``BLOCK_M``, so that every block of ``BLOCK_M`` sorted slots belongs to one expert,
   into buffers sized for the worst case (no count is read on the host), so that a decode step is
   capturable in a CUDA graph. Up to ``FUSED_ALIGN_PAIRS`` pairs both are two Triton programs
   (``route_and_align``); above, ``fd_core.runtimes.torch.ops.route`` and ``align`` (torch ops,
   whose launches cost little beside a prefill's GEMMs);
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
from fd_core.runtimes.torch import ops as reference

from fd_backend_cuda.kernels.quantized_linear import (
    _CODES,
    _int4_chunk,
    _step,
    pack_linear,
    weight_dot,
    weight_dot_constants,
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


def _capacity(pairs: int, experts: int, block_m: int) -> int:
    """Sorted slots for ``pairs`` over ``experts``, each expert's run padded to ``block_m``, in
    the worst case (at most ``min(experts, pairs)`` runs, each padded by up to ``block_m - 1``):
    a size that depends on the shapes alone, as a captured graph needs."""
    return triton.cdiv(pairs + min(experts, pairs) * (block_m - 1), block_m) * block_m


# Up to these many (token, k) pairs and local experts, routing and alignment run as two Triton
# programs instead of ~20 small torch kernels (45-125 us a layer on the H100, a third of the op at
# one row); above them (prefill) the torch form's cost is small beside the GEMMs.
FUSED_ALIGN_PAIRS = 1024
FUSED_ALIGN_EXPERTS = 256


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, E, FIRST, LOCAL,
                  TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token: scores, the top_k of score + bias (lower id on ties), their weights; ids are
    written local (``id - FIRST``; another rank's expert: ``LOCAL``)."""
    n = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    r = tl.load(logits_ptr + n * E + e, mask=ok, other=-float("inf"))
    if SOFTMAX:
        z = tl.exp(r - tl.max(r, axis=0))
        scores = z / tl.sum(z, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-r))
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=ok, other=0.0)
    choice = tl.where(ok, choice, -float("inf"))
    k = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_K,), dtype=tl.int32)
    weight = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.min(tl.where(choice == tl.max(choice, axis=0), e, BLOCK_E), axis=0)
        picked = tl.where(k == j, best, picked)
        weight = tl.where(k == j, tl.sum(tl.where(e == best, scores, 0.0), axis=0), weight)
        choice = tl.where(e == best, -float("inf"), choice)
    if RENORMALIZE:
        weight = weight / tl.sum(weight, axis=0)
    local = picked - FIRST
    local = tl.where((local >= 0) & (local < LOCAL), local, LOCAL)
    tl.store(ids_ptr + n * TOP_K + k, local, mask=k < TOP_K)
    tl.store(weights_ptr + n * TOP_K + k, weight, mask=k < TOP_K)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, P, E, CAPACITY,
                  BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr):
    """``align`` in one program: the pairs sorted by (expert, index), each expert's run padded to
    BLOCK_M; every slot then reads its pair from the sorted order (no scatter, so no barrier)."""
    i = tl.arange(0, BLOCK_P)
    expert = tl.load(ids_ptr + i, mask=i < P, other=E)  # pads and other ranks' experts: E
    order = tl.sort(expert * BLOCK_P + i)
    pair_of = order % BLOCK_P  # position in the sorted order -> pair index
    counts = tl.histogram(expert, BLOCK_E)
    bins = tl.arange(0, BLOCK_E)
    padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    first = tl.cumsum(counts, axis=0) - counts  # each expert's first position in the sorted order
    for s0 in range(0, CAPACITY, BLOCK_S):
        slot = s0 + tl.arange(0, BLOCK_S)
        # the slot's expert; past the padded total, E (as searchsorted says in ``align``)
        owner = tl.minimum(tl.sum((ends[None, :] <= slot[:, None]).to(tl.int32), axis=1), E)
        safe = tl.minimum(owner, BLOCK_E - 1)
        rank = slot - tl.gather(starts, safe, 0)
        real = (owner < E) & (rank < tl.gather(counts, safe, 0))
        position = tl.where(real, tl.gather(first, safe, 0) + rank, 0)
        pair = tl.where(real, tl.gather(pair_of, position, 0), P)
        tl.store(sorted_ptr + slot, pair, mask=slot < CAPACITY)
        head = (slot % BLOCK_M == 0) & (slot < CAPACITY)
        tl.store(block_expert_ptr + slot // BLOCK_M, owner, mask=head)


def route_and_align(logits: Tensor, top_k: int, scoring: str, renormalize: bool, correction_bias: Tensor | None,
                    expert_offset: int, local_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(local_ids, weights, sorted_pairs, block_expert)`` from the router's float32 logits
    ``[N, E]``, in two launches: what ``route`` and ``align`` compute, for up to
    ``FUSED_ALIGN_PAIRS`` pairs."""
    n, e = logits.shape
    pairs = n * top_k
    device = logits.device
    ids = torch.empty((n, top_k), dtype=torch.int32, device=device)
    weights = torch.empty((n, top_k), dtype=torch.float32, device=device)
    bias = correction_bias.float().contiguous() if correction_bias is not None else logits
    _route_kernel[(n,)](logits, bias, ids, weights, e, expert_offset, local_experts, TOP_K=top_k,
                        SOFTMAX=scoring == "softmax", HAS_BIAS=correction_bias is not None,
                        RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(e),
                        BLOCK_K=triton.next_power_of_2(top_k), num_warps=1)
    capacity = _capacity(pairs, local_experts, block_m)
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    # three sizes of sort, not one per power of two: each is a compile, and a server meets the
    # sizes of its mixed steps only while it serves
    block_p = next(size for size in (64, 256, FUSED_ALIGN_PAIRS) if pairs <= size)
    _align_kernel[(1,)](ids, sorted_pairs, block_expert, pairs, local_experts, capacity, BLOCK_M=block_m,
                        BLOCK_P=block_p, BLOCK_E=triton.next_power_of_2(local_experts + 1),
                        BLOCK_S=128, num_warps=8)
    return ids, weights, sorted_pairs, block_expert


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
    capacity = _capacity(count, num_experts, block_m)
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


def _experts_of(gate_up: Tensor | QuantizedWeight) -> int:
    return gate_up.qweight.shape[0] if isinstance(gate_up, QuantizedWeight) else gate_up.shape[0]


def _block_m(x: Tensor, gate_up: Tensor | QuantizedWeight, down: Tensor | QuantizedWeight, pairs: int) -> int:
    block_m = block_m_for(pairs, _experts_of(gate_up))
    if x.dtype == torch.float32 or PACKED_INT4 in (_kind(gate_up), _kind(down)):
        # float32 tiles take twice the bytes, int4's K step is its whole 256-column chunk:
        # 64-row blocks overflow the shared memory (measured on the H100)
        block_m = min(block_m, 32)
    return block_m


def fused_experts(x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor | QuantizedWeight,
                  down: Tensor | QuantizedWeight, expert_offset: int = 0, total_experts: int | None = None,
                  config: Config | None = None) -> Tensor:
    """``sum_k weights[n, k] * down[e] @ silu_and_mul(gate_up[e] @ x[n])`` with ``e`` the local
    expert ``ids[n, k] - expert_offset``; pairs whose expert is not local add nothing.
    ``config`` overrides the tiles (benchmarks)."""
    num_experts = _experts_of(gate_up)
    local = ids - expert_offset
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    block_m = _block_m(x, gate_up, down, ids.numel())
    sorted_pairs, block_expert = align(local, num_experts, block_m)
    partial = total_experts is not None and total_experts > num_experts
    return _grouped(x, ids.shape[1], weights, sorted_pairs, block_expert, block_m, gate_up, down, partial, config)


def _grouped(x: Tensor, top_k: int, weights: Tensor, sorted_pairs: Tensor, block_expert: Tensor, block_m: int,
             gate_up: Tensor | QuantizedWeight, down: Tensor | QuantizedWeight, partial: bool,
             config: Config | None = None) -> Tensor:
    """The two grouped GEMMs and the top-k sum over aligned pairs; ``partial``: some pairs' experts
    are another rank's (their rows stay zero)."""
    n, hidden = x.shape
    pairs = n * top_k
    num_experts = _experts_of(gate_up)
    inter = down.shape[1] if isinstance(down, QuantizedWeight) else down.shape[2]
    kinds = _kind(gate_up), _kind(down)
    xd = x if x.stride(-1) == 1 else x.contiguous()
    blocks = block_expert.numel()
    block_n, k_cap, warps, stages = config or _config(block_m, x.dtype)
    constants = weight_dot_constants(x.dtype)
    act = torch.empty((blocks * block_m, inter), dtype=x.dtype, device=x.device)
    w, s, z, se, sn, group, zeros = _operands(gate_up)
    _gate_up_kernel[(triton.cdiv(inter, block_n), blocks)](
        xd, w, s, z, act, sorted_pairs, block_expert, pairs, top_k, num_experts, inter, hidden, group,
        xd.stride(0), w.stride(0), w.stride(1), se, sn, act.stride(0),
        KIND=kinds[0], HAS_ZEROS=zeros, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=_step_k(gate_up, hidden, k_cap), num_warps=warps, num_stages=stages, **constants)
    # float32: a token's top_k rows may nearly cancel, and rounding each to 16 bits first
    # would cost the sum its low bits (the kit's float16 case caught it)
    y = (torch.zeros if partial else torch.empty)((pairs, hidden), dtype=torch.float32, device=x.device)
    w, s, z, se, sn, group, zeros = _operands(down)
    _down_kernel[(triton.cdiv(hidden, block_n), blocks)](
        act, w, s, z, y, sorted_pairs, block_expert, weights.reshape(-1).float().contiguous(), pairs,
        num_experts, hidden, inter, group, act.stride(0), w.stride(0), w.stride(1), se, sn, y.stride(0),
        KIND=kinds[1], HAS_ZEROS=zeros, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=_step_k(down, inter, k_cap), num_warps=warps, num_stages=stages, **constants)
    return y.view(n, top_k, hidden).sum(dim=1).to(x.dtype)


def moe(x: Tensor, router_weight: Tensor, gate_up, down, top_k: int, scoring: str = "softmax",
        renormalize: bool = True, correction_bias: Tensor | None = None, expert_offset: int = 0) -> Tensor:
    if isinstance(gate_up, list) or isinstance(down, list):  # pack_experts kept them: the reference
        return reference.moe(x, router_weight, gate_up, down, top_k, scoring, renormalize, correction_bias,
                             expert_offset)
    n, total = x.shape[0], router_weight.shape[0]
    if n == 0:
        return x.new_zeros((0, x.shape[1]))
    local = _experts_of(gate_up)
    if n * top_k > FUSED_ALIGN_PAIRS or local >= FUSED_ALIGN_EXPERTS or total > FUSED_ALIGN_EXPERTS:
        ids, weights = reference.route(x, router_weight, top_k, scoring, renormalize, correction_bias)
        return fused_experts(x, ids, weights, gate_up, down, expert_offset, total)
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"unknown moe scoring {scoring!r}")
    logits = torch.matmul(x.float(), router_weight.float().t())
    block_m = _block_m(x, gate_up, down, n * top_k)
    _, weights, sorted_pairs, block_expert = route_and_align(logits, top_k, scoring, renormalize, correction_bias,
                                                             expert_offset, local, block_m)
    return _grouped(x, top_k, weights, sorted_pairs, block_expert, block_m, gate_up, down, total > local)
