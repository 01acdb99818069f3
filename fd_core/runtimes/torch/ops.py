"""The PyTorch reference implementation of every op in ``fd_core.interfaces.ops``.

It mirrors the Paddle reference (``fd_core.runtimes.paddle.ops``) algorithm for algorithm, so a
model gives the same logits and, for a seeded request, the same tokens on either runtime. Float32
math on whatever device the tensors live on (CPU or CUDA; nothing here names a device): tensors
of other dtypes are cast in and their results cast back. Host-side work is limited to metadata
(built once per step and cached in ``AttentionMetadata.device``), MoE token grouping and the
two per-row key words of ``sample``'s noise, whose per-token part is computed on the logits'
device; it is ``fd_core.runtimes.host_plan``'s, shared with the Paddle reference.
``REFERENCE_OPS`` maps op name to function; a backend uses it for every op it does not implement
itself.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from fd_core.interfaces.ops import (
    AttentionMetadata,
    QuantizedWeight,
    SampleOutput,
    SamplingBatch,
)
from fd_core.quantization.kv_cache import (
    KV_QUANTIZED,
    SCALE_BYTES,
    STORAGE_FORMAT,
    plane_offsets,
)
from fd_core.runtimes import host_plan
from fd_core.runtimes.host_plan import AttentionPlan, Chunk, Decodes, device_plan

Tensor = torch.Tensor
_F32 = torch.float32


def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == _F32 else x.to(_F32)


def _to(x: Tensor, dtype: torch.dtype) -> Tensor:
    return x if x.dtype == dtype else x.to(dtype)


_PINNED_UPLOAD_BYTES = 4 << 20  # a step's inputs are far smaller


def upload(array: np.ndarray, device: torch.device, into: Tensor | None = None) -> Tensor:
    """A host array on ``device`` (or copied into the device tensor ``into``); on the CPU it may
    share the array's memory (callers pass temporaries they never write again).

    On a GPU the copy goes through pinned memory and is not waited for: torch copies from
    pageable memory with a stream synchronisation, which would hold the host until the device
    has finished all the work queued before it (and so undo asynchronous scheduling). The
    pinned block is not reused before the copy has run (torch's host allocator records it).
    Large arrays (weights, at load time) are copied the plain way: torch keeps pinned blocks
    cached, and pinning a whole checkpoint would hold as much host memory."""
    array = np.ascontiguousarray(array)
    if torch.device(device).type == "cuda" and array.nbytes <= _PINNED_UPLOAD_BYTES:
        # NumPy fills a block from torch's pinned allocator: pin_memory() copies with torch's
        # CPU copy, which splits an array of more than 32K elements over its OpenMP threads;
        # waking them cost 0.75 ms a step for 32 grammar masks on an H100 host
        # (docs/PERFORMANCE.md, "Structured output")
        host = torch.empty(array.shape, dtype=torch.from_numpy(array).dtype, pin_memory=True)
        np.copyto(host.numpy(), array, casting="no")
        if into is not None:
            return into.copy_(host, non_blocking=True)
        return host.to(device, non_blocking=True)
    host = torch.from_numpy(array)
    return host.to(device) if into is None else into.copy_(host)


def _host(x: Tensor) -> np.ndarray:
    return x.detach().cpu().numpy()


def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` along the first axis, for every dtype."""
    return x.index_select(0, index)


def put_rows(x: Tensor, index: Tensor, rows: Tensor) -> None:
    """``x[index] = rows`` in place, for every dtype (``index`` holds no duplicates)."""
    x.index_copy_(0, index, _to(rows, x.dtype))


def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    return take_rows(weight, ids)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    h = _f32(x)
    if residual is not None:
        h = h + _f32(residual)
    y = h * torch.rsqrt(torch.mean(h * h, dim=-1, keepdim=True) + eps) * _f32(weight)
    if residual is None:
        return _to(y, x.dtype)
    return _to(y, x.dtype), _to(h, x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    n, heads, dim = x.shape
    half = cos.shape[-1]
    rot = 2 * half
    h = _f32(x)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, R/2]: broadcast over the heads
    if style == "neox":
        a, b = h[..., :half], h[..., half:rot]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    elif style == "interleaved":
        a, b = h[..., :rot].reshape(n, heads, half, 2).unbind(-1)
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).reshape(n, heads, rot)
    else:
        raise ValueError(f"unknown rotary style {style!r}")
    if rot != dim:
        out = torch.cat([out, h[..., rot:]], dim=-1)
    return _to(out, x.dtype)


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin: Tensor, style: str
) -> tuple[Tensor, Tensor]:
    cs = _f32(take_rows(cos_sin, positions))  # [N, R]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, :half], cs[:, half:]
    return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = _F32) -> Tensor:
    """The ``[out, in]`` matrix a QuantizedWeight (canonical layout) stands for, in ``dtype``."""
    if weight.layout:
        raise ValueError(f"the reference reads only the canonical layout, not {weight.layout!r}")
    q = weight.qweight
    if weight.method == "block_wise_fp8" and q.dtype == torch.uint8:  # the e4m3fn bits
        q = q.view(torch.float8_e4m3fn)
    q = _f32(q)
    scales = _f32(weight.scales)
    out_features, in_features = q.shape
    if weight.method == "block_wise_fp8":
        block = weight.group_size
        s = torch.repeat_interleave(torch.repeat_interleave(scales, block, dim=0), block, dim=1)
        return _to(q * s[:out_features, :in_features], dtype)
    if weight.method not in ("wint8", "wint4"):
        raise ValueError(f"unknown quantization method {weight.method!r}")
    group = in_features if weight.group_size == -1 else weight.group_size
    groups = in_features // group
    w = q.reshape(out_features, groups, group) * scales.unsqueeze(-1)
    if weight.zeros is not None:
        w = w + _f32(weight.zeros).unsqueeze(-1)
    return _to(w.reshape(out_features, in_features), dtype)


def linear(x: Tensor, weight: Tensor | QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    # As in the Paddle reference, the matmul runs in x's dtype (cuBLAS accumulates half types in
    # float32). F.linear wants one dtype for all three; a mismatch only costs a cast.
    if isinstance(weight, QuantizedWeight):
        weight = dequantize(weight, x.dtype)
    return F.linear(x, _to(weight, x.dtype), None if bias is None else _to(bias, x.dtype))


def silu_and_mul(x: Tensor) -> Tensor:
    inter = x.shape[-1] // 2
    h = _f32(x)
    return _to(F.silu(h[..., :inter]) * h[..., inter:], x.dtype)


# --- attention ---------------------------------------------------------------------------------
#
# The same plan as the Paddle reference (``fd_core.runtimes.host_plan``, built on the host once
# per step), uploaded and run here: decodes in a few batched groups bucketed by cache length,
# prefills in chunks over only the keys they can see, the cache read by gathering rows of a
# ``[slots * Hk, D]`` view so that every matmul operand comes out contiguous.


def _plan(
    meta: AttentionMetadata, num_kv_heads: int, device: torch.device
) -> AttentionPlan[Tensor]:
    # The masks broadcast over the heads and the group ([Sd, 1, 1, T] and [L, 1, T]), so the
    # group size does not shape the plan and is not keyed.
    return device_plan(
        meta,
        f"torch.attention/{num_kv_heads}@{device}",
        num_kv_heads,
        lambda array: upload(array, device),
        lambda mask: mask[:, None, None, :],
        lambda mask: mask[:, None, :],
    )


# A quantized KV cache (fd_core.quantization.kv_cache): per block, a plane of int8 / uint8
# values and a plane of float16 scales; the storage dtype names the format.
_KV_TOP = {getattr(torch, name): KV_QUANTIZED[fmt] for name, fmt in STORAGE_FORMAT.items()}


def _kv_planes(cache: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Views of a quantized cache: values ``[blocks, block_size * Hk, D]`` and scales
    ``[blocks, block_size * Hk]`` float16, indexed by (block, offset * Hk + head)."""
    slots, heads, row = cache.shape
    head_dim = row - SCALE_BYTES
    block, split = plane_offsets(block_size, heads, head_dim)
    flat = cache.view(slots // block_size, block)
    values = flat[:, :split].unflatten(1, (block_size * heads, head_dim))
    return values, flat[:, split:].view(torch.float16)


def _kv_write(cache: Tensor, slots: Tensor, x: Tensor, block_size: int) -> None:
    h = _f32(x)
    top = _KV_TOP[cache.dtype]
    scale = (h.abs().amax(-1, keepdim=True) / top).to(torch.float16)
    scaled = torch.clamp(h / torch.where(scale == 0, 1.0, scale.float()), -top, top)
    if cache.dtype == torch.int8:
        values = torch.round(scaled).to(torch.int8)
    else:
        values = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    heads = cache.shape[1]
    rows = (slots[:, None] * heads + torch.arange(heads, device=slots.device)).reshape(-1)
    at = (rows // (block_size * heads), rows % (block_size * heads))
    value_plane, scale_plane = _kv_planes(cache, block_size)
    value_plane.index_put_(at, values.reshape(len(rows), -1))
    scale_plane.index_put_(at, scale.reshape(-1))


def _kv_read(cache: Tensor, rows: Tensor, block_size: int) -> Tensor:
    """``[len(rows), D]`` float32 of the (slot * Hk + head) ``rows``."""
    per_block = block_size * cache.shape[1]
    at = (rows // per_block, rows % per_block)
    value_plane, scale_plane = _kv_planes(cache, block_size)
    values = value_plane[at]
    decoded = values.float() if cache.dtype == torch.int8 else values.view(torch.float8_e4m3fn).float()
    return decoded * scale_plane[at].float()[:, None]


def _write_cache(cache: Tensor, slots: Tensor, rows: Tensor, block_size: int) -> None:
    if cache.dtype in _KV_TOP:
        _kv_write(cache, slots, rows, block_size)
    else:
        put_rows(cache, slots, rows)


def _read(cache: Tensor, rows: Tensor, block_size: int) -> Tensor:
    if cache.dtype in _KV_TOP:
        return _kv_read(cache, rows, block_size)
    return _f32(take_rows(cache.reshape(-1, cache.shape[-1]), rows))


def _decode_attention(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, d: Decodes[Tensor], scale: float,
    block_size: int
) -> Tensor:
    """Single-token queries at once, over their caches padded to the longest."""
    num_kv_heads, head_dim = key_cache.shape[1], q.shape[-1]
    shape = (d.count, num_kv_heads, d.length, head_dim)
    rows = q if d.queries is None else take_rows(q, d.queries)
    query = (rows * scale).reshape(d.count, num_kv_heads, -1, head_dim)  # [Sd, Hk, G, D]
    scores = query @ _read(key_cache, d.rows, block_size).reshape(shape).transpose(-1, -2)
    if d.bias is not None:
        scores = scores + d.bias
    out = torch.softmax(scores, dim=-1) @ _read(value_cache, d.rows, block_size).reshape(shape)
    return out.reshape(d.count, -1, head_dim)


def _prefill_attention(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, p: Chunk[Tensor], scale: float,
    block_size: int
) -> Tensor:
    """A chunk of one sequence's new tokens over the tokens they can see."""
    num_kv_heads, head_dim = key_cache.shape[1], q.shape[-1]
    length = p.end - p.start
    # Query rows ordered (token, group) inside each kv head, so the mask broadcasts per token.
    query = (q[p.start : p.end] * scale).reshape(length, num_kv_heads, -1, head_dim)
    group = query.shape[2]
    query = query.transpose(0, 1).reshape(num_kv_heads, length * group, head_dim)
    keys = _read(key_cache, p.rows, block_size).reshape(num_kv_heads, -1, head_dim)  # [Hk, T, D]
    scores = (query @ keys.transpose(-1, -2)).reshape(num_kv_heads, length, group, -1) + p.bias
    probs = torch.softmax(scores, dim=-1).reshape(num_kv_heads, length * group, -1)
    values = _read(value_cache, p.rows, block_size).reshape(num_kv_heads, -1, head_dim)
    out = (probs @ values).reshape(num_kv_heads, length, group, head_dim)
    return out.transpose(0, 1).reshape(length, -1, head_dim)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: tuple[Tensor, Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    key_cache, value_cache = kv_cache
    plan = _plan(meta, key_cache.shape[1], key_cache.device)
    _write_cache(key_cache, plan.slot_mapping, k, meta.block_size)
    _write_cache(value_cache, plan.slot_mapping, v, meta.block_size)
    if plan.empty:  # no sequence of the step has a new token, so q has no rows
        return torch.zeros_like(q)

    query = _f32(q)
    pieces = [_decode_attention(query, key_cache, value_cache, d, scale, meta.block_size) for d in plan.decodes]
    for chunk in plan.chunks:
        pieces.append(_prefill_attention(query, key_cache, value_cache, chunk, scale, meta.block_size))
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
    if plan.order is not None:
        out = take_rows(out, plan.order)
    return _to(out, q.dtype)


# --- moe ---------------------------------------------------------------------------------------


def route(
    x: Tensor,
    router_weight: Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(expert_ids [N, top_k], weights [N, top_k])`` of ``moe``'s router, best first."""
    logits = _f32(x) @ _f32(router_weight).T
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown moe scoring {scoring!r}")
    choice = scores if correction_bias is None else scores + _f32(correction_bias)
    # torch.topk does not promise which of tied experts it returns; a stable descending sort
    # gives the contract's lower id, and over E experts it costs next to nothing.
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(scores, -1, ids)
    if renormalize:
        weights = weights / torch.sum(weights, dim=-1, keepdim=True)
    return ids, weights


def _f32_weight(w: Tensor | QuantizedWeight) -> Tensor | QuantizedWeight:
    return w if isinstance(w, QuantizedWeight) else _f32(w)


def moe(
    x: Tensor,
    router_weight: Tensor,
    gate_up: list[Tensor],
    down: list[Tensor],
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: Tensor | None = None,
    expert_offset: int = 0,
) -> Tensor:
    ids, weights = route(x, router_weight, top_k, scoring, renormalize, correction_bias)
    h = _f32(x)
    if h.is_cuda and torch.cuda.is_current_stream_capturing():
        return _to(_moe_dense(h, ids, weights, gate_up, down, expert_offset), x.dtype)
    # on the host: one matmul per (local) expert
    groups = host_plan.expert_groups(_host(ids), expert_offset, len(gate_up))
    if not groups:  # no token chose an expert of this rank
        return torch.zeros_like(x)
    flat_weights = weights.reshape(-1, 1)
    outputs = []
    for e, pairs in groups:
        hidden = linear(take_rows(h, upload(pairs // top_k, h.device)), _f32_weight(gate_up[e]))
        y = linear(silu_and_mul(hidden), _f32_weight(down[e]))
        outputs.append(y * take_rows(flat_weights, upload(pairs, h.device)))
    index = upload(np.concatenate([pairs // top_k for _, pairs in groups]), h.device)
    out = torch.zeros_like(h).index_add_(0, index, torch.cat(outputs))
    return _to(out, x.dtype)


def _moe_dense(h: Tensor, ids: Tensor, weights: Tensor, gate_up: list, down: list, expert_offset: int) -> Tensor:
    """``moe`` without reading the choices on the host, as a captured graph needs (a backend's
    decode steps, e.g. CUDA graphs): every local expert runs on every row, weighted by the row's
    weight for it (zero where it chose another), so the work is E / top_k times the grouped
    form's. A backend with a fused kernel of its own does not come here."""
    count = len(gate_up)
    local = ids - expert_offset
    mine = (local >= 0) & (local < count)
    per_expert = torch.zeros((h.shape[0], count), dtype=torch.float32, device=h.device)
    per_expert.scatter_add_(1, local.clamp(0, count - 1), torch.where(mine, weights, 0.0))
    out = torch.zeros_like(h)
    for e in range(count):
        y = linear(silu_and_mul(linear(h, _f32_weight(gate_up[e]))), _f32_weight(down[e]))
        out = out + y * per_expert[:, e : e + 1]
    return out


# --- sample ------------------------------------------------------------------------------------
#
# Step for step the Paddle reference's algorithm (same order of penalties, top-k, top-p, min-p,
# the same nucleus search and the same counter-based noise), so that seeded rows draw the same
# token on both runtimes.

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)``: by the two 16-bit halves of ``c``,
    so that no product leaves int64 (a 32 x 32-bit product would overflow it)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _lowbias32(x: Tensor) -> Tensor:
    """``fd_core.testing.spec._lowbias32`` on int64 holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sampling_noise(
    batch: SamplingBatch, rows: np.ndarray, vocab: int, device: torch.device
) -> Tensor:
    """The contract's noise (``fd_core.testing.spec.counter_noise``) of the ``rows``, float32
    ``[len(rows), vocab]`` on ``device``, computed there: only the per-row keys come from the
    host. On the CPU, NumPy's uint32 arithmetic does the same some 30 times faster than int64
    tensors do."""
    if torch.device(device).type == "cpu":
        return torch.from_numpy(host_plan.noise(batch, rows, vocab))
    return _tensor_noise(upload(host_plan.noise_keys(batch, rows), device), vocab)


def _tensor_noise(keys: Tensor, vocab: int) -> Tensor:
    """``counter_noise`` of tokens ``0..vocab-1`` under int64 ``keys [R, 2]``, with tensor ops."""
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)[None, :]
    h = _lowbias32(_lowbias32(ids ^ keys[:, :1]) ^ keys[:, 1:])
    v = torch.clamp((h >> 1).to(_F32), min=1.0) * 2.0**-31  # exact: a power of two
    return -torch.log1p(-torch.clamp(v, max=1 - 2.0**-24))


def _column(values: np.ndarray, device: torch.device) -> Tensor:
    """A per-row host parameter as a float32 ``[S, 1]`` device column, to broadcast over V."""
    return upload(np.asarray(values, dtype=np.float32)[:, None], device)


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, then frequency and presence penalties (float32 ``[S, V]`` in and out).

    Only the token ids travel to the device; counts and per-token factors are scattered there.
    """
    num_rows, vocab = logits.shape
    device = logits.device
    where = host_plan.penalties(batch, vocab)

    def dense(index: np.ndarray, values: np.ndarray, fill: float) -> Tensor:
        base = torch.full((num_rows * vocab,), fill, dtype=_F32, device=device)
        if len(index):
            base[upload(index, device)] = upload(values, device)
        return base.reshape(num_rows, vocab)

    factor = dense(where.seen, where.factors, 1.0)
    count = dense(where.output, where.counts, 0.0)
    # Unseen tokens have factor 1, so both branches leave them exactly as they were.
    x = torch.where(logits > 0, logits / factor, logits * factor)
    freq = _column(batch.frequency_penalty, device)
    presence = _column(batch.presence_penalty, device)
    return x - freq * count - presence * (count > 0).to(_F32)


def bias(x: Tensor, batch: SamplingBatch) -> Tensor:
    """``x`` with each row's ``logit_bias`` added; a new tensor (x may be the caller's logits).
    Only the biased entries travel and change: a row's ids are distinct, so a gather, an add and
    a scatter give exactly ``x[i, ids] + values``."""
    num_rows, vocab = x.shape
    index, values = host_plan.biases(batch, vocab)
    if not len(index):
        return x
    flat = x.reshape(-1)
    where = upload(index, x.device)
    return flat.index_put((where,), flat[where] + upload(values, x.device)).reshape(num_rows, vocab)


def suppress(x: Tensor, batch: SamplingBatch) -> Tensor:
    """``x`` with the suppressed ids at -inf; a new tensor (x may be the caller's logits)."""
    num_rows, vocab = x.shape
    index = host_plan.suppressed(batch, vocab)
    if not len(index):
        return x
    out = x.reshape(-1).index_fill(0, upload(index, x.device), float("-inf"))
    return out.reshape(num_rows, vocab)


def upload_bitmask(mask: np.ndarray, device: torch.device) -> Tensor:
    """``SamplingBatch.allowed_token_bitmask`` on ``device``: packed (1/32 of a bool mask's
    bytes), for ``disallow`` to unpack there."""
    return upload(np.ascontiguousarray(mask, dtype=np.int32), device)


def disallow(x: Tensor, words: Tensor) -> Tensor:
    """``x`` with every token the rows' packed bitmask ``words`` (``upload_bitmask``) leaves
    out at -inf (a new tensor)."""
    num_rows, vocab = x.shape
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = ((words.unsqueeze(-1) >> shifts) & 1).reshape(num_rows, -1)[:, :vocab]
    return x.masked_fill(bits == 0, float("-inf"))


def _nucleus_head(
    probs: Tensor, top_p: Tensor, active: np.ndarray, head: Tensor | None = None
) -> Tensor:
    """The leading, descending part of each row of ``probs`` that holds its top-p nucleus.

    A full sort over the vocabulary is slow on CPU (milliseconds a row), and the nucleus is
    almost always among the few hundred most likely tokens: try ``head`` (the top-k survivors,
    when given), then the top 256, widening only while some active row's head holds less than
    its ``top_p``.
    """
    vocab = probs.shape[1]
    width = 256 if head is None else head.shape[1]
    while width < vocab:
        if head is None:
            head = torch.topk(probs, width, dim=-1).values
        # The head's own running sum, as the full cumulative sum would compute it.
        mass = torch.cumsum(head, dim=-1)[:, -1:]
        if np.all(_host(mass >= top_p).reshape(-1) | ~active):
            return head
        head = None
        width *= 8
    return torch.sort(probs, dim=-1, descending=True).values


def _top_k(z: Tensor, top_k: np.ndarray, limited: np.ndarray) -> tuple[Tensor, Tensor]:
    """``z`` without the tokens below each limited row's k-th best (ties at the edge stay), and
    the top ``max(k)`` values of the result, best first."""
    device = z.device
    best = torch.topk(z, int(top_k[limited].max()), dim=-1).values
    kth = torch.gather(best, -1, upload(np.where(limited, top_k - 1, 0)[:, None], device))
    kth = torch.where(upload(limited[:, None], device), kth, torch.full_like(kth, -np.inf))
    z = torch.where(z >= kth, z, torch.full_like(z, -np.inf))
    best = torch.where(best >= kth, best, torch.full_like(best, -np.inf))
    return z, best


def _top_p(
    weights: Tensor, best: Tensor | None, top_p: Tensor, nucleus: np.ndarray, limited: np.ndarray
) -> Tensor:
    """The normalised distribution, zero outside each nucleus row's top-p set (widened to every
    token tied with the last one kept); rows without top-p keep every token."""
    total = torch.sum(weights, dim=-1, keepdim=True)
    probs = weights / total
    # Top-k on every top-p row: its sorted survivors are already the head to search.
    head = torch.exp(best) / total if best is not None and limited[nucleus].all() else None
    ordered = _nucleus_head(probs, top_p, nucleus, head)
    # The mass ahead of each token: an exclusive running sum (``cumsum - ordered`` would round
    # differently from the spec's).
    running = torch.cumsum(ordered, dim=-1)
    before = torch.cat([torch.zeros_like(ordered[:, :1]), running[:, :-1]], dim=-1)
    keep = torch.sum(before < top_p, dim=-1, keepdim=True)
    edge = torch.gather(ordered, -1, torch.clamp(keep, min=1) - 1)
    # Rows without top-p get edge 0, which keeps every token.
    edge = torch.where(upload(nucleus[:, None], probs.device), edge, torch.zeros_like(edge))
    return torch.where(probs >= edge, probs, torch.zeros_like(probs))


def _draw_weights(x: Tensor, batch: SamplingBatch, rows: np.ndarray) -> Tensor:
    """For the non-greedy ``rows``: weights proportional to the filtered distribution
    (temperature, top-k, top-p, min-p). The draw is an argmax, so they need no normalising."""
    device = x.device
    vocab = x.shape[1]
    # Subtracting the max first keeps a tiny temperature from overflowing to inf - inf.
    z = (x - torch.amax(x, dim=-1, keepdim=True)) / _column(batch.temperature[rows], device)

    top_k = batch.top_k[rows]
    limited = (top_k > 0) & (top_k < vocab)
    best = None  # the top-k values of z, best first, masked like z
    if limited.any():
        z, best = _top_k(z, top_k, limited)
    weights = torch.exp(z)

    nucleus = batch.top_p[rows] < 1
    if nucleus.any():
        top_p = _column(batch.top_p[rows], device)
        weights = _top_p(weights, best, top_p, nucleus, limited)

    if (batch.min_p[rows] > 0).any():
        floor = _column(batch.min_p[rows], device) * torch.amax(weights, dim=-1, keepdim=True)
        weights = torch.where(weights >= floor, weights, torch.zeros_like(weights))
    return weights


def _top_logprobs(raw: Tensor, lse: Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best raw logprobs of each row, best first, ties to the lower id."""
    values, ids = torch.topk(raw, k, dim=-1)
    at_least_last = torch.sum(raw >= values[:, -1:], dim=-1)
    if host_plan.top_k_ties_unresolved(_host(values), _host(at_least_last)):
        values, ids = torch.sort(raw, dim=-1, descending=True, stable=True)
        values, ids = values[:, :k], ids[:, :k]
    return _host(ids).astype(np.int64), _host(values - lse)


def sample(logits: Tensor, batch: SamplingBatch) -> SampleOutput:
    raw = _f32(logits)
    num_rows, vocab = raw.shape
    device = raw.device
    greedy = batch.temperature == 0

    x = bias(raw, batch) if batch.logit_bias is not None else raw
    if batch.needs_penalties:
        x = apply_penalties(x, batch)
    if batch.needs_suppression:
        x = suppress(x, batch)
    if batch.allowed_token_bitmask is not None:
        x = disallow(x, upload_bitmask(batch.allowed_token_bitmask, x.device))

    if greedy.all():  # the common fast path: no sorting, no noise
        tokens = torch.argmax(x, dim=-1, keepdim=True)
        token_ids = _host(tokens).reshape(-1).astype(np.int64)
    else:
        rows = np.flatnonzero(~greedy)
        sub = x if len(rows) == num_rows else take_rows(x, upload(rows, device))
        weights = _draw_weights(sub, batch, rows)
        noise = sampling_noise(batch, rows, vocab, device)
        token_ids = np.zeros(num_rows, dtype=np.int64)
        token_ids[rows] = _host(torch.argmax(weights / noise, dim=-1))
        if greedy.any():
            token_ids[greedy] = _host(torch.argmax(x, dim=-1))[greedy]
        tokens = upload(token_ids[:, None], device)

    return _scored(raw, tokens, token_ids, batch.num_logprobs)


def _scored(raw: Tensor, tokens: Tensor, token_ids: np.ndarray, num_logprobs: int) -> SampleOutput:
    """The raw logprob and rank of each row's token (``tokens [R, 1]`` on the device,
    ``token_ids`` the same on the host) and the row's ``num_logprobs`` best."""
    chosen = torch.gather(raw, -1, tokens)
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)
    # Ranked on raw logits: the order of the logprobs, with no rounding in between.
    ranks = torch.sum(raw >= chosen, dim=-1)
    if num_logprobs > 0:
        top_ids, top_logprobs = _top_logprobs(raw, lse, num_logprobs)
    else:
        top_ids = np.zeros((len(token_ids), 0), dtype=np.int64)
        top_logprobs = np.zeros((len(token_ids), 0), dtype=np.float32)
    return SampleOutput(
        token_ids=token_ids,
        logprobs=_host(chosen - lse).reshape(-1),
        ranks=_host(ranks).astype(np.int64),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def token_logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: int) -> SampleOutput:
    return _scored(_f32(logits), token_ids[:, None], _host(token_ids).astype(np.int64), num_logprobs)


REFERENCE_OPS: dict[str, Callable] = {
    "embedding": embedding,
    "rms_norm": rms_norm,
    "rotary": rotary,
    "linear": linear,
    "silu_and_mul": silu_and_mul,
    "attention": attention,
    "moe": moe,
    "sample": sample,
    "token_logprobs": token_logprobs,
}
