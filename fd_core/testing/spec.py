"""The executable specification of every op in ``fd_core.interfaces.ops``, in NumPy.

Each function has the op's name and signature, with NumPy arrays in place of tensors (the KV cache
is a ``(key, value)`` pair of arrays, written in place; a QuantizedWeight holds arrays). They favour
being obviously right over being fast: loops over sequences, rows and experts are kept where they
mirror the text of the contract. Backends are tested against these functions with ``TOLERANCES``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from fd_core.interfaces.ops import (
    FP8_BLOCK,
    AttentionMetadata,
    QuantizedWeight,
    SampleOutput,
    SamplingBatch,
    unpack_token_bitmask,
)

# dequantize: the matrix a QuantizedWeight stands for, one function for the spec and the loaders
from fd_core.quantization.host import dequantize, fp8_e4m3fn_values  # noqa: E402, F401

# the quantized KV cache's format (--kv-cache-dtype int8 / fp8_e4m3): one for the spec and the runtimes
from fd_core.quantization.kv_cache import read_slots, write_slots  # noqa: E402
from fd_core.quantization.quantize import fp8_blocks  # noqa: E402
from fd_core.quantization.kv_cache import format_of as kv_format  # noqa: E402

# Per-op tolerances (for np.testing.assert_allclose) of a float32 implementation against this
# specification. Lookups and integer outputs are exact; reductions may differ in summation order.
TOLERANCES: dict[str, dict[str, float]] = {
    "embedding": {"rtol": 0.0, "atol": 0.0},
    "rms_norm": {"rtol": 1e-5, "atol": 1e-5},
    "rotary": {"rtol": 1e-5, "atol": 1e-5},
    "linear": {"rtol": 1e-4, "atol": 1e-4},
    "silu_and_mul": {"rtol": 1e-5, "atol": 1e-6},
    "attention": {"rtol": 1e-4, "atol": 1e-5},
    "rotary_attention": {"rtol": 1e-4, "atol": 1e-5},  # attention's
    "moe": {"rtol": 1e-4, "atol": 1e-4},
    "sample": {"rtol": 1e-5, "atol": 1e-5},  # for logprobs; token ids and ranks are exact
    "sample_async": {"rtol": 1e-5, "atol": 1e-5},  # its result(), as sample's
    "token_logprobs": {"rtol": 1e-5, "atol": 1e-5},  # as sample's: ids and ranks exact
    "pack_linear": {"rtol": 0.0, "atol": 0.0},  # tested through linear: what it returns is private
    "pack_experts": {"rtol": 0.0, "atol": 0.0},  # tested through moe, as pack_linear is
    "deferred_bitmask": {"rtol": 1e-5, "atol": 1e-5},  # tested through sample_async's result()
}

# A 16-bit implementation computes in float32 (the contract says where) on the same rounded
# inputs as the specification, and rounds its result once more at the end; attention may also
# round its probabilities to the operand dtype before the product with V, as GPU kernels do.
# That last rounding is at most half a unit in the last place: 2**-11 of the result in float16,
# 2**-8 (0.0039) in bfloat16. The bounds are about four times that (atol = rtol, at the scale of
# the outputs, which the cases draw of order 1): room for a few roundings of intermediates, none
# for a sum kept in the 16-bit type. Such a sum is rounded at every addition, by up to 2**-8 of
# the partial sum in bfloat16: over K terms of random sign these errors add up like sqrt(K) of
# them, and terms of one sign stop adding at all once each is below 2**-9 of the sum. A float32
# sum rounds by 2**-24 instead, still ~1e-5 of the output over 16,384 terms.
# opcases' long-reduction cases (LONG_LINEAR, LONG_RMS_NORM, LONG_DECODE) measure it: the torch
# reference's worst error on them is 0.22 of the bound, a bfloat16 running sum's 13-49 times it,
# and one rounded after every 16 terms (a kernel with a bfloat16 accumulator over 16-deep
# tensor-core steps) 2.4-5.6 times it (tests/plugins/bf16_accumulator.py).
HALF_TOLERANCES: dict[str, dict[str, float]] = {
    "float16": {"rtol": 2e-3, "atol": 2e-3},
    "bfloat16": {"rtol": 1.6e-2, "atol": 1.6e-2},
}
# A quantized linear may round its activations, its scales and zeros and its result to bfloat16
# (PyTorch's int4/int8 CPU kernels do all four), for outputs of magnitude ~1.
QUANTIZED_LINEAR_TOLERANCE: dict[str, float] = {"rtol": 2e-2, "atol": 2e-2}
HALF_ATTENTION_TOLERANCES: dict[str, dict[str, float]] = {
    "float16": {"rtol": 5e-3, "atol": 5e-3},
    "bfloat16": {"rtol": 2e-2, "atol": 2e-2},
}


def tolerance(op: str, dtype: str = "float32", quantization: str | None = None) -> dict[str, float]:
    """``assert_allclose`` tolerances of ``op`` computed in ``dtype`` against this specification
    run in float32 on the same (rounded) inputs. Exact ops stay exact; ``sample``'s logprobs are
    computed in float32 whatever the logits' dtype. A quantized ``linear`` (and ``moe`` on
    quantized experts) may round to bfloat16 (``QUANTIZED_LINEAR_TOLERANCE``) whatever
    ``dtype``; a 16-bit ``moe`` may round the activation between its two products to the
    operand dtype, as attention its probabilities."""
    if op in ("linear", "moe") and quantization:
        return QUANTIZED_LINEAR_TOLERANCE
    if dtype == "float32" or op in ("embedding", "sample", "sample_async", "token_logprobs", "deferred_bitmask"):
        return TOLERANCES[op]
    table = HALF_ATTENTION_TOLERANCES if op in ("attention", "rotary_attention", "moe") else HALF_TOLERANCES
    if dtype not in table:
        raise ValueError(f"no stated tolerance for dtype {dtype!r}; known: float32, {', '.join(table)}")
    return table[dtype]


def _softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def embedding(weight: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return weight[ids]


def rms_norm(
    x: np.ndarray, weight: np.ndarray, eps: float, residual: np.ndarray | None = None
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    dtype = x.dtype
    h = x.astype(np.float32)
    if residual is not None:
        h = h + residual.astype(np.float32)
    y = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * weight.astype(np.float32)
    if residual is None:
        return y.astype(dtype)
    return y.astype(dtype), h.astype(dtype)


def rotary(
    positions: np.ndarray, q: np.ndarray, k: np.ndarray, cos_sin: np.ndarray, style: str
) -> tuple[np.ndarray, np.ndarray]:
    rot = cos_sin.shape[1]
    half = rot // 2
    cos = cos_sin[positions, :half][:, None, :].astype(np.float32)  # [N, 1, R/2]
    sin = cos_sin[positions, half:][:, None, :].astype(np.float32)

    def apply(x: np.ndarray) -> np.ndarray:
        out = x.astype(np.float32).copy()
        if style == "neox":
            first, second = np.arange(half), np.arange(half, rot)
        elif style == "interleaved":
            first, second = np.arange(0, rot, 2), np.arange(1, rot, 2)
        else:
            raise ValueError(f"unknown rotary style {style!r}")
        a, b = out[..., first], out[..., second]
        out[..., first] = a * cos - b * sin
        out[..., second] = b * cos + a * sin
        return out.astype(x.dtype)

    return apply(q), apply(k)


def rotary_attention(positions: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, cos_sin: np.ndarray,
                     style: str, kv_cache: tuple[np.ndarray, np.ndarray], meta: AttentionMetadata,
                     scale: float) -> np.ndarray:
    """``rotary``, then ``attention`` on its results (writes ``kv_cache`` in place)."""
    q, k = rotary(positions, q, k, cos_sin, style)
    return attention(q, k, v, kv_cache, meta, scale)


def pack_linear(weight: QuantizedWeight) -> QuantizedWeight:
    """The specification packs nothing: its linear reads the canonical layout."""
    return weight


def pack_experts(gate_up: list, down: list) -> tuple[list, list]:
    """The specification packs nothing: its moe reads the lists."""
    return gate_up, down


def linear(
    x: np.ndarray, weight: np.ndarray | QuantizedWeight, bias: np.ndarray | None = None
) -> np.ndarray:
    w = dequantize(weight) if isinstance(weight, QuantizedWeight) else weight.astype(np.float32)
    y = x.astype(np.float32) @ w.T
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y.astype(x.dtype)


def fp8_activations(x: np.ndarray) -> np.ndarray:
    """``x`` ``[N, in]`` as a W8A8 ``block_wise_fp8`` linear may round it before the product
    (FastDeploy's and DeepSeek-V3's recipe): per row and 128 columns, ``scale = max|x| / 448``
    (float32) and each value the nearest e4m3fn value of ``x / scale`` (scale 0 taken as 1),
    times the scale."""
    bits, scales = fp8_blocks(x, 1, FP8_BLOCK)
    return fp8_e4m3fn_values()[bits] * np.repeat(scales, FP8_BLOCK, axis=1)[:, : bits.shape[1]]


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    inter = x.shape[-1] // 2
    h = x.astype(np.float32)
    return (_silu(h[..., :inter]) * h[..., inter:]).astype(x.dtype)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    kv_cache: tuple[np.ndarray, np.ndarray],
    meta: AttentionMetadata,
    scale: float,
) -> np.ndarray:
    key_cache, value_cache = kv_cache
    quantized = kv_format(key_cache.dtype)  # an int8 / uint8 cache: fd_core.quantization.kv_cache

    def write(cache: np.ndarray, rows: np.ndarray) -> None:
        if quantized:
            write_slots(cache, meta.block_size, meta.slot_mapping, rows)
        else:
            cache[meta.slot_mapping] = rows.astype(cache.dtype)

    def read(cache: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return read_slots(cache, meta.block_size, slots) if quantized else cache[slots].astype(np.float32)

    write(key_cache, k)
    write(value_cache, v)

    num_q_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_q_heads // num_kv_heads
    bs = meta.block_size
    out = np.zeros(q.shape, dtype=np.float32)
    for i in range(meta.num_seqs):
        start, end = int(meta.query_start_loc[i]), int(meta.query_start_loc[i + 1])
        if end == start:
            continue
        context, total = int(meta.context_lens[i]), int(meta.seq_lens[i])
        pos = np.arange(total)
        slots = meta.block_tables[i][pos // bs] * bs + pos % bs
        # query head h reads kv head h // group
        keys = np.repeat(read(key_cache, slots), group, axis=1)  # [T, Hq, D]
        values = np.repeat(read(value_cache, slots), group, axis=1)
        query = q[start:end].astype(np.float32)  # [L, Hq, D]
        scores = np.einsum("lhd,thd->hlt", query, keys) * scale
        query_pos = context + np.arange(end - start)
        visible = pos[None, :] <= query_pos[:, None]  # [L, T]
        probs = _softmax(np.where(visible, scores, -np.inf))
        out[start:end] = np.einsum("hlt,thd->lhd", probs, values)
    return out.astype(q.dtype)


def route(
    x: np.ndarray,
    router_weight: np.ndarray,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The router of ``moe``: ``(expert_ids [N, top_k], weights [N, top_k])``, best first.

    Ties between experts go to the lower expert id.
    """
    logits = x.astype(np.float32) @ router_weight.astype(np.float32).T
    if scoring == "softmax":
        scores = _softmax(logits)
    elif scoring == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        raise ValueError(f"unknown moe scoring {scoring!r}")
    choice = scores if correction_bias is None else scores + correction_bias.astype(np.float32)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / np.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def moe(
    x: np.ndarray,
    router_weight: np.ndarray,
    gate_up: list[np.ndarray],
    down: list[np.ndarray],
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: np.ndarray | None = None,
    expert_offset: int = 0,
) -> np.ndarray:
    ids, weights = route(x, router_weight, top_k, scoring, renormalize, correction_bias)
    out = np.zeros(x.shape, dtype=np.float32)
    for n in range(x.shape[0]):
        for e, w in zip(ids[n], weights[n], strict=True):
            local = int(e) - expert_offset
            if not 0 <= local < len(gate_up):  # another rank's expert (expert parallelism)
                continue
            h = linear(x[n : n + 1].astype(np.float32), gate_up[local])
            out[n] += w * linear(silu_and_mul(h), down[local])[0]
    return out.astype(x.dtype)


# --- sampling noise ----------------------------------------------------------------------------
#
# Counter-based: the noise of token ``t`` in a row is a pure function of (seed, step, t) built from
# 32-bit unsigned xor, shifts and multiplications mod 2**32, so NumPy, torch (int64 masked to 32
# bits), Paddle and a GPU kernel all compute the same bits, element by element, with no
# generator state. Only the final float32 ``log1p`` may differ in its last ulps.

_U32 = np.uint32


def _fmix32(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 32-bit finalizer (a bijection of uint32), for the per-row keys."""
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x85EBCA6B)
    x = x ^ (x >> _U32(13))
    x = x * _U32(0xC2B2AE35)
    return x ^ (x >> _U32(16))


def _lowbias32(x: np.ndarray) -> np.ndarray:
    """Wellons' "lowbias32" integer hash (a bijection of uint32), for the per-token mix."""
    x = x ^ (x >> _U32(16))
    x = x * _U32(0x7FEB352D)
    x = x ^ (x >> _U32(15))
    x = x * _U32(0x846CA68B)
    return x ^ (x >> _U32(16))


def sampling_keys(seeds: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two uint32 key words of each row's noise, from its int64 seed (``0 <= seed < 2**63``)
    and step (its low 32 bits)::

        lo, hi, st = seed & 0xFFFFFFFF, seed >> 32, step & 0xFFFFFFFF
        key0 = fmix32(fmix32(fmix32(lo ^ 0x243F6A88) ^ hi) ^ st)
        key1 = fmix32(fmix32(fmix32(st ^ 0x85A308D3) ^ lo) ^ hi)
    """
    seeds = np.asarray(seeds, dtype=np.int64)
    steps = np.asarray(steps, dtype=np.int64)
    lo = (seeds & 0xFFFFFFFF).astype(_U32)
    hi = ((seeds >> 32) & 0xFFFFFFFF).astype(_U32)
    st = (steps & 0xFFFFFFFF).astype(_U32)
    key0 = _fmix32(_fmix32(_fmix32(lo ^ _U32(0x243F6A88)) ^ hi) ^ st)
    key1 = _fmix32(_fmix32(_fmix32(st ^ _U32(0x85A308D3)) ^ lo) ^ hi)
    return key0, key1


def counter_noise(key0: np.ndarray, key1: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """The Exponential(1) noise of ``token_ids`` under the keys (arrays broadcast together)::

        h = lowbias32(lowbias32(t ^ key0) ^ key1)
        v = min(max(float32(h >> 1), 1) * 2**-31, 1 - 2**-24)     # uniform in (0, 1)
        noise = -log1p(-v)                                           # in float32

    ``float32(h >> 1)`` rounds to nearest (exact below 2**24); ``max``/``min`` keep ``v`` strictly
    inside (0, 1), so the noise is finite and positive. Small noise, which is what wins the race
    for unlikely tokens, keeps the hash's full 31-bit resolution (``-log(u)`` of a float32 ``u``
    near 1 would round it to multiples of 2**-24).
    """
    h = _lowbias32(_lowbias32(np.asarray(token_ids).astype(_U32) ^ key0) ^ key1)
    f = (h >> _U32(1)).astype(np.int32).astype(np.float32)
    v = np.minimum(np.maximum(f, np.float32(1)) * np.float32(2.0**-31), np.float32(1 - 2.0**-24))
    return -np.log1p(-v)


def sampling_noise(seeds: np.ndarray, steps: np.ndarray, vocab: int) -> np.ndarray:
    """Float32 ``[S, vocab]``: row ``i`` is ``counter_noise`` of tokens ``0..vocab-1`` under
    ``sampling_keys(seeds, steps)[:, i]``. Computed a few rows at a time, which keeps the
    temporaries in cache (several times faster at a 100k vocabulary)."""
    key0, key1 = sampling_keys(seeds, steps)
    ids = np.arange(vocab, dtype=_U32)[None, :]
    out = np.empty((len(key0), vocab), dtype=np.float32)
    for i in range(0, len(key0), 8):
        out[i : i + 8] = counter_noise(key0[i : i + 8, None], key1[i : i + 8, None], ids)
    return out


def apply_logit_bias(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """Each row's ``logit_bias`` added to its logits, in float32 (a copy)."""
    out = logits.astype(np.float32).copy()
    for i, (ids, values) in enumerate(batch.logit_bias or []):
        out[i, ids] += np.asarray(values, dtype=np.float32)
    return out


def apply_penalties(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """Repetition, then frequency and presence penalties, as vLLM applies them."""
    out = logits.astype(np.float32).copy()
    vocab = out.shape[1]
    for i in range(out.shape[0]):
        counts = np.bincount(batch.output_token_ids[i], minlength=vocab)[:vocab]
        seen = counts > 0
        seen[batch.prompt_token_ids[i]] = True
        r = np.float32(batch.repetition_penalty[i])
        row = out[i]
        row = np.where(seen, np.where(row > 0, row / r, row * r), row)
        row = row - np.float32(batch.frequency_penalty[i]) * counts.astype(np.float32)
        row = row - np.float32(batch.presence_penalty[i]) * (counts > 0).astype(np.float32)
        out[i] = row
    return out


def filtered_probs(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
) -> np.ndarray:
    """The distribution one non-greedy row draws from (float32 ``[V]``, sums to 1).

    Temperature, then top-k (every token at least as likely as the k-th best; ties at the edge
    stay), then top-p (tokens, most likely first, while the mass before them is below ``top_p``,
    so the smallest set reaching it; widened to every token tied with the last one kept), then
    min-p (tokens with probability below ``min_p * max_prob`` go).
    """
    vocab = logits.shape[0]
    # Subtracting the max first keeps a tiny temperature from overflowing to inf - inf.
    z = (logits - np.max(logits)) / np.float32(temperature)
    if 0 < top_k < vocab:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    probs = _softmax(z).astype(np.float32)
    if top_p < 1:
        ordered = np.sort(probs)[::-1]
        mass_before = np.concatenate([[0.0], np.cumsum(ordered)[:-1]]).astype(np.float32)
        keep = max(1, int(np.sum(mass_before < np.float32(top_p))))
        probs = np.where(probs >= ordered[keep - 1], probs, 0.0).astype(np.float32)
    if min_p > 0:
        probs = np.where(probs >= np.float32(min_p) * np.max(probs), probs, 0.0)
    return (probs / np.sum(probs)).astype(np.float32)


def sample(logits: np.ndarray, batch: SamplingBatch) -> SampleOutput:
    """Token choice, then the raw logprob, rank and top logprobs of each row.

    A non-greedy row draws ``token = argmax(probs / noise)`` with
    ``noise = sampling_noise([seed], [step], V)[0]``, float32 Exponential(1) noise that is a
    function of (seed, step, token id) alone: the exponential race, which picks token ``t`` with
    probability ``probs[t]`` (ties: lowest id). The rank of the sampled token is the number of
    tokens whose raw logprob is at least its own (vLLM's count, so ties share the worse rank),
    counted on the raw float32 logits, which have the same order without the rounding of the
    log-softmax. ``top_ids`` ties go to the lower id.
    """
    scores = logits.astype(np.float32)
    raw = _log_softmax(scores).astype(np.float32)
    num_rows, vocab = logits.shape
    x = apply_penalties(apply_logit_bias(logits, batch), batch)
    for i, ids in enumerate(batch.suppress_token_ids):
        x[i, ids] = -np.inf
    if batch.allowed_token_bitmask is not None:
        x[~unpack_token_bitmask(batch.allowed_token_bitmask, vocab)] = -np.inf

    tokens = np.zeros(num_rows, dtype=np.int64)
    for i in range(num_rows):
        if batch.temperature[i] == 0:
            tokens[i] = np.argmax(x[i])
            continue
        probs = filtered_probs(
            x[i],
            float(batch.temperature[i]),
            int(batch.top_k[i]),
            float(batch.top_p[i]),
            float(batch.min_p[i]),
        )
        noise = sampling_noise(batch.seeds[i : i + 1], batch.steps[i : i + 1], vocab)[0]
        tokens[i] = np.argmax(probs / noise)

    return _scored(scores, raw, tokens, batch.num_logprobs)


def _scored(scores: np.ndarray, raw: np.ndarray, tokens: np.ndarray, num_logprobs: int) -> SampleOutput:
    """The raw logprob and rank of each row's token, and the row's ``num_logprobs`` best,
    given the float32 logits ``scores`` and their log-softmax ``raw``."""
    rows = np.arange(len(tokens))
    chosen = raw[rows, tokens]
    ranks = np.sum(scores >= scores[rows, tokens][:, None], axis=1).astype(np.int64)
    top_ids = np.argsort(-scores, axis=1, kind="stable")[:, :num_logprobs].astype(np.int64)
    return SampleOutput(
        token_ids=tokens,
        logprobs=chosen.astype(np.float32),
        ranks=ranks,
        top_ids=top_ids,
        top_logprobs=np.take_along_axis(raw, top_ids, axis=1).astype(np.float32),
    )


def token_logprobs(logits: np.ndarray, token_ids: np.ndarray, num_logprobs: int) -> SampleOutput:
    """What ``sample`` reports of a token, for tokens given instead of drawn (a prompt's):
    log-softmax in float32 with no penalty or filter, the rank among the raw logits (ties share
    the worse rank), the ``num_logprobs`` best with ties to the lower id."""
    scores = logits.astype(np.float32)
    return _scored(scores, _log_softmax(scores).astype(np.float32), np.asarray(token_ids, dtype=np.int64),
                   num_logprobs)


class SampledOnHost:
    """``sample_async``'s PendingSample for NumPy: the sample is done; ``feed`` scatters it."""

    def __init__(self, output: SampleOutput) -> None:
        self.output = output

    def feed(self, ids: np.ndarray, dest: np.ndarray, src: np.ndarray) -> np.ndarray:
        out = np.array(ids, dtype=np.int64)
        out[dest] = self.output.token_ids[src]
        return out

    def result(self) -> SampleOutput:
        return self.output


class HostBitmask:
    """``deferred_bitmask``'s DeferredBitmask for NumPy: the array, and an event set by ready()."""

    def __init__(self, rows: int, words: int) -> None:
        self.array = np.full((rows, words), -1, dtype=np.int32)
        self.filled = threading.Event()

    def ready(self) -> None:
        self.filled.set()


def deferred_bitmask(rows: int, words: int) -> HostBitmask:
    return HostBitmask(rows, words)


class SampledLate(SampledOnHost):
    """``sample_async``'s PendingSample drawn when the tokens are first asked for, once a
    HostBitmask in the batch is ready, as a device would run it."""

    def __init__(self, logits: np.ndarray, batch: SamplingBatch,
                 draw: Callable[..., SampleOutput] | None = None) -> None:
        self.logits, self.batch, self.lock = logits, batch, threading.Lock()
        self.draw = draw or sample  # a runtime's sample, for a test emulating a device with it
        self._output: SampleOutput | None = None

    @property
    def output(self) -> SampleOutput:  # type: ignore[override]
        with self.lock:
            if self._output is None:
                batch, mask = self.batch, self.batch.allowed_token_bitmask
                if isinstance(mask, HostBitmask):
                    if not mask.filled.wait(60):
                        raise TimeoutError("the deferred bitmask was never ready")
                    batch = dataclasses.replace(batch, allowed_token_bitmask=mask.array)
                self._output = self.draw(self.logits, batch)
            return self._output


def sample_async(logits: np.ndarray, batch: SamplingBatch) -> SampledOnHost:
    """``sample``, handed back as a PendingSample (the op's semantics; no asynchrony in NumPy,
    except that a deferred bitmask is read when the tokens are asked for)."""
    if isinstance(batch.allowed_token_bitmask, HostBitmask):
        return SampledLate(logits, batch)
    return SampledOnHost(sample(logits, batch))
