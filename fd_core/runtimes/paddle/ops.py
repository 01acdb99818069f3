"""The Paddle reference implementation of every op in ``fd_core.interfaces.ops``.

Float32 math on whatever device the tensors live on; tensors of other dtypes are cast in and
their results cast back. Host-side work is limited to metadata (built once per step and cached
in ``AttentionMetadata.device``), MoE token grouping and the per-row noise of ``sample`` (the
contract's counter-based noise, computed with NumPy); it is ``fd_core.runtimes.host_plan``'s,
shared with the other runtimes. ``REFERENCE_OPS`` maps op name to function; a backend uses it for every op it does
not implement itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import paddle
import paddle.nn.functional as F

from fd_core.interfaces.ops import (
    AttentionMetadata,
    QuantizedWeight,
    SampleOutput,
    SamplingBatch,
    unpack_token_bitmask,
)
from fd_core.quantization.kv_cache import (
    KV_QUANTIZED,
    SCALE_BYTES,
    STORAGE_FORMAT,
    plane_offsets,
)
from fd_core.runtimes import host_plan
from fd_core.runtimes.host_plan import AttentionPlan, Chunk, Decodes, device_plan

Tensor = paddle.Tensor
_F32 = paddle.float32


def _f32(x: Tensor) -> Tensor:
    return x if x.dtype == _F32 else x.astype(_F32)


def _to(x: Tensor, dtype: paddle.dtype) -> Tensor:
    return x if x.dtype == dtype else x.astype(dtype)


def _upload(array: np.ndarray, place: paddle.Place) -> Tensor:
    return paddle.to_tensor(np.ascontiguousarray(array), place=place)


def take_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x[index]`` along the first axis, for every dtype."""
    # CPU Paddle has no float16 gather kernel; indexing covers it, about 50x slower.
    if x.dtype == paddle.float16 and x.place.is_cpu_place():
        return x[index]
    return paddle.gather(x, index)


def put_rows(x: Tensor, index: Tensor, rows: Tensor) -> None:
    """``x[index] = rows`` in place, for every dtype."""
    # scatter_ is the fastest in-place write, but CPU Paddle registers it for 32/64-bit types only.
    if x.dtype in (paddle.float32, paddle.float64):
        paddle.scatter_(x, index, _to(rows, x.dtype))
    else:
        paddle.index_put_(x, (index,), _to(rows, x.dtype))


def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    return take_rows(weight, ids)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    h = _f32(x)
    if residual is not None:
        h = h + _f32(residual)
    y = h * paddle.rsqrt(paddle.mean(h * h, axis=-1, keepdim=True) + eps) * _f32(weight)
    if residual is None:
        return _to(y, x.dtype)
    return _to(y, x.dtype), _to(h, x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    n, heads, dim = x.shape
    half = cos.shape[-1]
    rot = 2 * half
    h = _f32(x)
    # Expanded to the full shape first: Paddle broadcasts over a middle axis ~10x slower.
    cos = paddle.expand(cos.unsqueeze(1), [n, heads, half])
    sin = paddle.expand(sin.unsqueeze(1), [n, heads, half])
    if style == "neox":
        a, b = h[..., :half], h[..., half:rot]
        out = paddle.concat([a * cos - b * sin, b * cos + a * sin], axis=-1)
    elif style == "interleaved":
        pairs = (h if rot == dim else h[..., :rot]).reshape([n, heads, half, 2])
        a, b = paddle.unbind(pairs, axis=-1)
        out = paddle.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
        out = out.reshape([n, heads, rot])
    else:
        raise ValueError(f"unknown rotary style {style!r}")
    if rot != dim:
        out = paddle.concat([out, h[..., rot:]], axis=-1)
    return _to(out, x.dtype)


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin: Tensor, style: str
) -> tuple[Tensor, Tensor]:
    cs = _f32(take_rows(cos_sin, positions))  # [N, R]
    half = cs.shape[-1] // 2
    cos, sin = cs[:, :half], cs[:, half:]
    return _rotate(q, cos, sin, style), _rotate(k, cos, sin, style)


def dequantize(weight: QuantizedWeight, dtype: paddle.dtype = _F32) -> Tensor:
    """The ``[out, in]`` matrix a QuantizedWeight (canonical layout) stands for, in ``dtype``."""
    if weight.layout:
        raise ValueError(f"the reference reads only the canonical layout, not {weight.layout!r}")
    q = weight.qweight
    if weight.method == "block_wise_fp8" and q.dtype == paddle.uint8:  # the e4m3fn bits
        q = q.view(paddle.float8_e4m3fn)
    q = _f32(q)
    scales = _f32(weight.scales)
    out_features, in_features = q.shape
    if weight.method == "block_wise_fp8":
        block = weight.group_size
        s = paddle.repeat_interleave(paddle.repeat_interleave(scales, block, axis=0), block, axis=1)
        return _to(q * s[:out_features, :in_features], dtype)
    if weight.method not in ("wint8", "wint4"):
        raise ValueError(f"unknown quantization method {weight.method!r}")
    group = in_features if weight.group_size == -1 else weight.group_size
    groups = in_features // group
    w = q.reshape([out_features, groups, group]) * scales.unsqueeze(-1)
    if weight.zeros is not None:
        w = w + _f32(weight.zeros).unsqueeze(-1)
    return _to(w.reshape([out_features, in_features]), dtype)


def linear(x: Tensor, weight: Tensor | QuantizedWeight, bias: Tensor | None = None) -> Tensor:
    if isinstance(weight, QuantizedWeight):
        weight = dequantize(weight, x.dtype)
    y = paddle.matmul(x, weight, transpose_y=True)
    return y if bias is None else y + bias


def silu_and_mul(x: Tensor) -> Tensor:
    # swiglu splits its single input into (gate, up) halves, exactly this op, in one kernel.
    return F.swiglu(x)


# --- attention ---------------------------------------------------------------------------------
#
# The plan (``fd_core.runtimes.host_plan``) is built on the host once per step; here it is
# uploaded and run. Reading the cache through gathered rows keeps every operand contiguous: on
# CPU, Paddle's matmul over a transposed view is an order of magnitude slower than the gather
# that avoids it.


def _plan(
    meta: AttentionMetadata, num_kv_heads: int, group: int, place: paddle.Place
) -> AttentionPlan[Tensor]:
    # The masks are expanded to their full shapes ([Sd, Hk, G, T] and [L, G, T]): Paddle
    # broadcasts over a middle axis ~10x slower.
    def decode_bias(mask: np.ndarray) -> np.ndarray:
        return np.broadcast_to(
            mask[:, None, None, :], (len(mask), num_kv_heads, group, mask.shape[-1])
        )

    return device_plan(
        meta,
        f"paddle.attention/{num_kv_heads}x{group}@{place}",
        num_kv_heads,
        lambda array: _upload(array, place),
        decode_bias,
        lambda mask: np.repeat(mask[:, None], group, 1),
    )


# A quantized KV cache (fd_core.quantization.kv_cache): per block, a plane of int8 / uint8
# values and a plane of float16 scales; the storage dtype names the format.
_KV_TOP = {getattr(paddle, name): KV_QUANTIZED[fmt] for name, fmt in STORAGE_FORMAT.items()}


def _kv_planes(cache: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Views of a quantized cache (writes reach the cache): values ``[blocks, block_size * Hk,
    D]`` and the float16 scales' bits as int16 ``[blocks, block_size * Hk]``, both indexed by
    (block, offset * Hk + head)."""
    slots, heads, row = cache.shape
    head_dim = row - SCALE_BYTES
    block, split = plane_offsets(block_size, heads, head_dim)
    flat = cache.reshape([slots // block_size, block])
    values = flat[:, :split].reshape([-1, block_size * heads, head_dim])
    # int16, viewed before slicing: CPU Paddle has no float16 gather_nd / index_put, and 3.3's
    # dtype view of an offset slice loses the offset
    return values, flat.view(paddle.int16)[:, split // 2 :]


def _kv_index(rows: Tensor, per_block: int) -> tuple[Tensor, Tensor]:
    return rows // per_block, rows % per_block


def _kv_write(cache: Tensor, slots: Tensor, x: Tensor, block_size: int) -> None:
    h = _f32(x)
    top = _KV_TOP[cache.dtype]
    scale = (h.abs().max(axis=-1, keepdim=True) / top).astype(paddle.float16)
    rounded = scale.astype(paddle.float32)  # CPU Paddle has no float16 where
    safe = paddle.where(rounded == 0, paddle.ones_like(rounded), rounded)
    scaled = paddle.clip(h / safe, -top, top)
    if cache.dtype == paddle.int8:
        values = paddle.round(scaled).astype(paddle.int8)
    else:
        values = scaled.astype(paddle.float8_e4m3fn).view(paddle.uint8)
    heads = cache.shape[1]
    rows = (slots.astype(paddle.int64)[:, None] * heads + paddle.arange(heads, dtype=paddle.int64)).reshape([-1])
    at = _kv_index(rows, block_size * heads)
    value_plane, scale_plane = _kv_planes(cache, block_size)
    paddle.index_put_(value_plane, at, values.reshape([rows.shape[0], -1]))
    paddle.index_put_(scale_plane, at, scale.reshape([-1]).view(paddle.int16))


def _kv_read(cache: Tensor, rows: Tensor, block_size: int) -> Tensor:
    """``[len(rows), D]`` float32 of the (slot * Hk + head) ``rows``."""
    at = paddle.stack(_kv_index(rows.astype(paddle.int64), block_size * cache.shape[1]), axis=-1)
    value_plane, scale_plane = _kv_planes(cache, block_size)
    values = paddle.gather_nd(value_plane, at)
    if cache.dtype == paddle.int8:
        decoded = values.astype(paddle.float32)
    else:
        decoded = values.view(paddle.float8_e4m3fn).astype(paddle.float32)
    scales = paddle.gather_nd(scale_plane, at).view(paddle.float16).astype(paddle.float32)
    return decoded * scales[:, None]


def _write_cache(cache: Tensor, slots: Tensor, rows: Tensor, block_size: int) -> None:
    if cache.dtype in _KV_TOP:
        _kv_write(cache, slots, rows, block_size)
    else:
        put_rows(cache, slots, rows)


def _read(cache: Tensor, rows: Tensor, block_size: int) -> Tensor:
    if cache.dtype in _KV_TOP:
        return _kv_read(cache, rows, block_size)
    return _f32(take_rows(cache.reshape([-1, cache.shape[-1]]), rows))


def _decode_attention(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, d: Decodes[Tensor], scale: float,
    block_size: int
) -> Tensor:
    """Single-token queries at once, over their caches padded to the longest."""
    num_kv_heads, head_dim = key_cache.shape[1], q.shape[-1]
    shape = [d.count, num_kv_heads, d.length, head_dim]
    rows = q if d.queries is None else paddle.gather(q, d.queries)
    query = (rows * scale).reshape([d.count, num_kv_heads, -1, head_dim])  # [Sd, Hk, G, D]
    scores = paddle.matmul(query, _read(key_cache, d.rows, block_size).reshape(shape), transpose_y=True)
    if d.bias is not None:
        scores = scores + d.bias
    out = paddle.matmul(F.softmax(scores, axis=-1), _read(value_cache, d.rows, block_size).reshape(shape))
    return out.reshape([d.count, -1, head_dim])


def _prefill_attention(
    q: Tensor, key_cache: Tensor, value_cache: Tensor, p: Chunk[Tensor], scale: float,
    block_size: int
) -> Tensor:
    """A chunk of one sequence's new tokens over the tokens they can see."""
    num_kv_heads, head_dim = key_cache.shape[1], q.shape[-1]
    length = p.end - p.start
    # Query rows ordered (token, group) inside each kv head, so the mask broadcasts per token.
    query = (q[p.start : p.end] * scale).reshape([length, num_kv_heads, -1, head_dim])
    group = query.shape[2]
    query = query.transpose([1, 0, 2, 3]).reshape([num_kv_heads, length * group, head_dim])
    keys = _read(key_cache, p.rows, block_size).reshape([num_kv_heads, -1, head_dim])  # [Hk, T, D]
    scores = paddle.matmul(query, keys, transpose_y=True)  # [Hk, L*G, T]
    scores = scores.reshape([num_kv_heads, length, group, -1]) + p.bias
    probs = F.softmax(scores, axis=-1).reshape([num_kv_heads, length * group, -1])
    values = _read(value_cache, p.rows, block_size).reshape([num_kv_heads, -1, head_dim])
    out = paddle.matmul(probs, values).reshape([num_kv_heads, length, group, head_dim])
    return out.transpose([1, 0, 2, 3]).reshape([length, -1, head_dim])


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: tuple[Tensor, Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    key_cache, value_cache = kv_cache
    plan = _plan(meta, key_cache.shape[1], q.shape[1] // key_cache.shape[1], key_cache.place)
    _write_cache(key_cache, plan.slot_mapping, k, meta.block_size)
    _write_cache(value_cache, plan.slot_mapping, v, meta.block_size)
    if plan.empty:  # no sequence of the step has a new token, so q has no rows
        return paddle.zeros_like(q)

    query = _f32(q)
    pieces = [_decode_attention(query, key_cache, value_cache, d, scale, meta.block_size) for d in plan.decodes]
    for chunk in plan.chunks:
        pieces.append(_prefill_attention(query, key_cache, value_cache, chunk, scale, meta.block_size))
    out = pieces[0] if len(pieces) == 1 else paddle.concat(pieces, axis=0)
    if plan.order is not None:
        out = paddle.gather(out, plan.order)
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
    logits = paddle.matmul(_f32(x), _f32(router_weight), transpose_y=True)
    if scoring == "softmax":
        scores = F.softmax(logits, axis=-1)
    elif scoring == "sigmoid":
        scores = F.sigmoid(logits)
    else:
        raise ValueError(f"unknown moe scoring {scoring!r}")
    choice = scores if correction_bias is None else scores + _f32(correction_bias)
    # paddle.topk does not promise which of tied experts it returns; a stable ascending sort of
    # the negated choice gives the contract's lower id, and over E experts it costs next to
    # nothing.
    ids = paddle.argsort(-choice, axis=-1, stable=True)[:, :top_k]
    weights = paddle.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / paddle.sum(weights, axis=-1, keepdim=True)
    return ids, weights


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
    # on the host: one matmul per (local) expert
    groups = host_plan.expert_groups(ids.numpy(), expert_offset, len(gate_up))
    if not groups:  # no token chose an expert of this rank
        return paddle.zeros_like(x)
    flat_weights = weights.reshape([-1, 1])
    outputs = []
    for e, pairs in groups:
        tokens = _upload(pairs // top_k, h.place)
        hidden = linear(paddle.gather(h, tokens), _f32_weight(gate_up[e]))
        y = linear(silu_and_mul(hidden), _f32_weight(down[e]))
        outputs.append(y * paddle.gather(flat_weights, _upload(pairs, h.place)))
    index = _upload(np.concatenate([pairs // top_k for _, pairs in groups]), h.place)
    out = paddle.zeros(h.shape, dtype=_F32).index_add_(index, 0, paddle.concat(outputs))
    return _to(out, x.dtype)


def _f32_weight(w: Tensor | QuantizedWeight) -> Tensor | QuantizedWeight:
    return w if isinstance(w, QuantizedWeight) else _f32(w)


# --- sample ------------------------------------------------------------------------------------


def apply_penalties(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Repetition, then frequency and presence penalties (float32 ``[S, V]`` in and out).

    Only the token ids travel to the device; counts and per-token factors are scattered there.
    """
    num_rows, vocab = logits.shape
    place = logits.place
    where = host_plan.penalties(batch, vocab)

    def dense(index: np.ndarray, values: np.ndarray, fill: float) -> Tensor:
        base = paddle.full([num_rows * vocab], fill, dtype=_F32)
        if len(index):
            base = paddle.scatter(base, _upload(index, place), _upload(values, place))
        return base.reshape([num_rows, vocab])

    factor = dense(where.seen, where.factors, 1.0)
    count = dense(where.output, where.counts, 0.0)
    # Unseen tokens have factor 1, so both branches leave them exactly as they were.
    x = paddle.where(logits > 0, logits / factor, logits * factor)
    freq = _upload(batch.frequency_penalty.astype(np.float32)[:, None], place)
    presence = _upload(batch.presence_penalty.astype(np.float32)[:, None], place)
    return x - freq * count - presence * (count > 0).astype(_F32)


def _bias(x: Tensor, batch: SamplingBatch) -> Tensor:
    """``x`` with each row's ``logit_bias`` added; a new tensor (x may be the caller's logits)."""
    num_rows, vocab = x.shape
    index, values = host_plan.biases(batch, vocab)
    if not len(index):
        return x
    flat = x.reshape([-1])
    where = _upload(index, x.place)
    out = paddle.scatter(flat, where, paddle.gather(flat, where) + _upload(values, x.place))
    return out.reshape([num_rows, vocab])


def _suppress(x: Tensor, batch: SamplingBatch) -> Tensor:
    num_rows, vocab = x.shape
    index = host_plan.suppressed(batch, vocab)
    if not len(index):
        return x
    values = paddle.full([len(index)], float("-inf"), dtype=_F32)
    out = paddle.scatter(x.reshape([-1]), _upload(index, x.place), values)
    return out.reshape([num_rows, vocab])


def _disallow(x: Tensor, batch: SamplingBatch) -> Tensor:
    """``x`` with every token the row's ``allowed_token_bitmask`` leaves out at -inf."""
    allowed = unpack_token_bitmask(batch.allowed_token_bitmask, x.shape[1])
    return paddle.where(_upload(allowed, x.place), x, paddle.full_like(x, float("-inf")))


def _row_sum(x: Tensor) -> Tensor:
    """Row sums of a float32 ``[S, V]`` as ``[S, 1]``.

    CPU Paddle reduces a row sequentially: over a 50k vocabulary that loses ~1e-5 (visible in
    logprobs and at the top-p edge) and is slow for several rows. Summing blocks of 256 with a
    BLAS matmul first is both accurate and fast; integer counts stay exact.
    """
    rows, n = x.shape
    block = math.gcd(n, 256)
    ones = paddle.ones([block, 1], dtype=x.dtype, device=x.place)
    partial = paddle.matmul(x.reshape([-1, block]), ones)
    return paddle.sum(partial.reshape([rows, -1]), axis=-1, keepdim=True)


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
            head, _ = paddle.topk(probs, width, axis=-1)
        # The head's own running sum, as the full cumulative sum would compute it.
        mass = paddle.cumsum(head, axis=-1)[:, -1:]
        if np.all((mass >= top_p).numpy().reshape(-1) | ~active):
            return head
        head = None
        width *= 8
    return paddle.sort(probs, axis=-1, descending=True)


def _draw_weights(x: Tensor, batch: SamplingBatch, rows: np.ndarray) -> Tensor:
    """For the non-greedy ``rows``: weights proportional to the filtered distribution
    (temperature, top-k, top-p, min-p). The draw is an argmax, so they need no normalising."""
    place = x.place
    vocab = x.shape[1]
    column = lambda a: _upload(a[rows].astype(np.float32)[:, None], place)
    # Subtracting the max first keeps a tiny temperature from overflowing to inf - inf.
    z = (x - paddle.max(x, axis=-1, keepdim=True)) / column(batch.temperature)

    top_k = batch.top_k[rows]
    limited = (top_k > 0) & (top_k < vocab)
    best = None  # the top-k values of z, best first, masked like z
    if limited.any():
        best, _ = paddle.topk(z, int(top_k[limited].max()), axis=-1)
        kth = paddle.take_along_axis(
            best, _upload(np.where(limited, top_k - 1, 0)[:, None], place), axis=-1
        )
        kth = paddle.where(_upload(limited[:, None], place), kth, paddle.full_like(kth, -np.inf))
        z = paddle.where(z >= kth, z, paddle.full_like(z, -np.inf))
        best = paddle.where(best >= kth, best, paddle.full_like(best, -np.inf))
    weights = paddle.exp(z)

    nucleus = batch.top_p[rows] < 1
    if nucleus.any():
        total = _row_sum(weights)
        probs = weights / total
        top_p = column(batch.top_p)
        # Top-k on every top-p row: its sorted survivors are already the head to search.
        head = paddle.exp(best) / total if best is not None and limited[nucleus].all() else None
        ordered = _nucleus_head(probs, top_p, nucleus, head)
        before = paddle.concat(
            [paddle.zeros([len(rows), 1], dtype=_F32), paddle.cumsum(ordered, axis=-1)[:, :-1]],
            axis=-1,
        )
        keep = _row_sum((before < top_p).astype(_F32))
        last = paddle.clip(keep, min=1).astype(paddle.int64) - 1
        edge = paddle.take_along_axis(ordered, last, axis=-1)
        # Rows without top-p get edge 0, which keeps every token.
        edge = paddle.where(_upload(nucleus[:, None], place), edge, paddle.zeros_like(edge))
        weights = paddle.where(probs >= edge, probs, paddle.zeros_like(probs))

    if (batch.min_p[rows] > 0).any():
        floor = column(batch.min_p) * paddle.max(weights, axis=-1, keepdim=True)
        weights = paddle.where(weights >= floor, weights, paddle.zeros_like(weights))
    return weights


def _top_logprobs(raw: Tensor, lse: Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best raw logprobs of each row, best first, ties to the lower id."""
    values, ids = paddle.topk(raw, k, axis=-1)
    at_least_last = _row_sum((raw >= values[:, -1:]).astype(_F32))
    if host_plan.top_k_ties_unresolved(values.numpy(), at_least_last.numpy()):
        # A stable ascending sort of the negated logits: equal ones keep their id order.
        ids = paddle.argsort(-raw, axis=-1, stable=True)[:, :k]
        values = paddle.take_along_axis(raw, ids, axis=-1)
    return ids.numpy().astype(np.int64), (values - lse).numpy()


def sample(logits: Tensor, batch: SamplingBatch) -> SampleOutput:
    raw = _f32(logits)
    num_rows, vocab = raw.shape
    greedy = batch.temperature == 0

    x = _bias(raw, batch) if batch.logit_bias is not None else raw
    if batch.needs_penalties:
        x = apply_penalties(x, batch)
    if batch.needs_suppression:
        x = _suppress(x, batch)
    if batch.allowed_token_bitmask is not None:
        x = _disallow(x, batch)

    if greedy.all():  # the common fast path: no sorting, no noise
        tokens = paddle.argmax(x, axis=-1, keepdim=True)
        token_ids = tokens.numpy().reshape(-1).astype(np.int64)
    else:
        rows = np.flatnonzero(~greedy)
        sub = x if len(rows) == num_rows else paddle.gather(x, _upload(rows, x.place))
        weights = _draw_weights(sub, batch, rows)
        noise = _upload(host_plan.noise(batch, rows, vocab), x.place)
        token_ids = np.zeros(num_rows, dtype=np.int64)
        token_ids[rows] = paddle.argmax(weights / noise, axis=-1).numpy()
        if greedy.any():
            token_ids[greedy] = paddle.argmax(x, axis=-1).numpy()[greedy]
        tokens = _upload(token_ids[:, None], x.place)

    # Greedy on unmodified logits picked the row max already.
    return _scored(raw, tokens, token_ids, batch.num_logprobs, at_max=x is raw and greedy.all())


def _scored(raw: Tensor, tokens: Tensor, token_ids: np.ndarray, num_logprobs: int,
            at_max: bool = False) -> SampleOutput:
    """The raw logprob and rank of each row's token (``tokens [R, 1]`` on the device,
    ``token_ids`` the same on the host) and the row's ``num_logprobs`` best; ``at_max``: every
    row's token holds its row's largest logit."""
    chosen = paddle.take_along_axis(raw, tokens, axis=-1)
    # Raw logprobs without F.log_softmax, which is pathologically slow over a 50k vocab on CPU;
    # the shift by a known row max saves a reduction.
    shift = chosen if at_max else paddle.max(raw, axis=-1, keepdim=True)
    lse = shift + paddle.log(_row_sum(paddle.exp(raw - shift)))
    # Ranked on raw logits: the order of the logprobs, with no rounding in between.
    ranks = _row_sum((raw >= chosen).astype(_F32))
    if num_logprobs > 0:
        top_ids, top_logprobs = _top_logprobs(raw, lse, num_logprobs)
    else:
        top_ids = np.zeros((len(token_ids), 0), dtype=np.int64)
        top_logprobs = np.zeros((len(token_ids), 0), dtype=np.float32)
    return SampleOutput(
        token_ids=token_ids,
        logprobs=(chosen - lse).numpy().reshape(-1),
        ranks=ranks.numpy().reshape(-1).astype(np.int64),
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )


def token_logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: int) -> SampleOutput:
    return _scored(_f32(logits), token_ids.reshape([-1, 1]), token_ids.numpy().astype(np.int64), num_logprobs)


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
