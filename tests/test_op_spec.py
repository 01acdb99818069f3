"""The Paddle reference ops (with the host-side planning they share with the other runtimes,
``fd_core.runtimes.host_plan``) equal the NumPy specification, and the specification itself
agrees with first-principles computations (so a bug in the spec cannot hide behind an equal
bug)."""

from __future__ import annotations

import itertools

import numpy as np
import paddle
import pytest

from fd_core.interfaces.ops import (
    OP_SPECS,
    AttentionMetadata,
    QuantizedWeight,
    SamplingBatch,
)
from fd_core.quantization.quantize import quantize  # noqa: E402
from fd_core.runtimes import host_plan
from fd_core.runtimes.paddle import REFERENCE_OPS
from fd_core.runtimes.paddle import ops as pd_ops
from fd_core.testing import spec
from fd_core.testing.batches import make_sampling_batch
from fd_core.testing.opcases import attention_step as build_step  # noqa: E402
from fd_core.testing.spec import TOLERANCES


def pd(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(a)


def close(name: str, actual, expected) -> None:
    actual = actual.numpy() if isinstance(actual, paddle.Tensor) else actual
    np.testing.assert_allclose(actual, expected, **TOLERANCES[name])


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def test_every_op_has_a_spec_a_reference_and_a_tolerance():
    required = {name for name, s in OP_SPECS.items() if not s.optional}
    # token_logprobs is optional for a backend, which falls back to the reference's
    assert set(REFERENCE_OPS) == required | {"token_logprobs"} and set(OP_SPECS) == set(TOLERANCES)
    assert all(callable(getattr(spec, name)) for name in OP_SPECS)


# --- embedding, rms_norm, silu_and_mul ---------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 64])
def test_embedding(n):
    rng = np.random.default_rng(n)
    weight = randn(rng, 50, 24)
    ids = rng.integers(0, 50, n).astype(np.int64)
    expected = spec.embedding(weight, ids)
    np.testing.assert_array_equal(expected, np.stack([weight[i] for i in ids]))
    close("embedding", REFERENCE_OPS["embedding"](pd(weight), pd(ids)), expected)


@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (2, 3, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape, with_residual):
    rng = np.random.default_rng(len(shape) + shape[-1])
    x, weight = randn(rng, *shape), randn(rng, shape[-1])
    residual = randn(rng, *shape) if with_residual else None
    expected = spec.rms_norm(x, weight, 1e-6, residual)
    actual = REFERENCE_OPS["rms_norm"](
        pd(x), pd(weight), 1e-6, None if residual is None else pd(residual)
    )
    if with_residual:
        close("rms_norm", actual[0], expected[0])
        close("rms_norm", actual[1], expected[1])
    else:
        close("rms_norm", actual, expected)


def test_rms_norm_spec_from_first_principles():
    rng = np.random.default_rng(1)
    x, residual, weight = randn(rng, 5, 32), randn(rng, 5, 32), randn(rng, 32)
    # eps = 0, unit weight: every row comes out with root-mean-square exactly 1 and scale-free.
    y = spec.rms_norm(x, np.ones(32, np.float32), 0.0)
    np.testing.assert_allclose(np.sqrt(np.mean(y.astype(np.float64) ** 2, axis=-1)), 1, rtol=1e-6)
    np.testing.assert_allclose(spec.rms_norm(3 * x, np.ones(32, np.float32), 0.0), y, rtol=1e-5)
    # With a residual: normalise the sum, and hand the sum back as the next residual.
    y, summed = spec.rms_norm(x, weight, 1e-5, residual)
    np.testing.assert_allclose(summed, x + residual, rtol=1e-6)
    np.testing.assert_allclose(y, spec.rms_norm(x + residual, weight, 1e-5), rtol=1e-6)
    h = (x + residual).astype(np.float64)
    direct = [row / np.sqrt(np.sum(row**2) / 32 + 1e-5) * weight for row in h]
    np.testing.assert_allclose(y, direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,inter", [(1, 8), (5, 64), (33, 1536)])
def test_silu_and_mul(n, inter):
    rng = np.random.default_rng(inter)
    x = randn(rng, n, 2 * inter)
    expected = spec.silu_and_mul(x)
    gate, up = x[:, :inter].astype(np.float64), x[:, inter:].astype(np.float64)
    np.testing.assert_allclose(expected, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)
    close("silu_and_mul", REFERENCE_OPS["silu_and_mul"](pd(x)), expected)


# --- rotary ------------------------------------------------------------------------------------


def cos_sin_table(max_pos: int, rot: int, base: float = 10000.0) -> np.ndarray:
    inv_freq = 1.0 / base ** (np.arange(0, rot, 2) / rot)
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("head_dim,rot", [(32, 32), (64, 64), (128, 128), (64, 32), (128, 64)])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("n", [1, 11])
def test_rotary(style, head_dim, rot, heads, n):
    rng = np.random.default_rng(head_dim + rot + n)
    positions = rng.integers(0, 300, n).astype(np.int64)
    q, k = randn(rng, n, heads[0], head_dim), randn(rng, n, heads[1], head_dim)
    table = cos_sin_table(512, rot)
    eq, ek = spec.rotary(positions, q, k, table, style)
    aq, ak = REFERENCE_OPS["rotary"](pd(positions), pd(q), pd(k), pd(table), style)
    close("rotary", aq, eq)
    close("rotary", ak, ek)


def test_rotary_spec_from_first_principles():
    rng = np.random.default_rng(2)
    head_dim, rot = 16, 8
    table = cos_sin_table(64, rot)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)
    x = randn(rng, 3, 2, head_dim)
    positions = np.array([0, 5, 63])

    # Interleaved: each pair (2i, 2i+1) is the complex number x_2i + j x_2i+1 times e^{j p f_i}.
    out, _ = spec.rotary(positions, x, x, table, "interleaved")
    z = x[..., 0:rot:2] + 1j * x[..., 1:rot:2].astype(np.float64)
    z = z * np.exp(1j * positions[:, None, None] * inv_freq)
    np.testing.assert_allclose(out[..., 0:rot:2], z.real, atol=1e-5)
    np.testing.assert_allclose(out[..., 1:rot:2], z.imag, atol=1e-5)
    np.testing.assert_array_equal(out[..., rot:], x[..., rot:])  # partial rotary passes the rest
    np.testing.assert_allclose(out[0], x[0], atol=1e-7)  # position 0 is the identity

    # neox is interleaved with the rotated dims permuted: neox dim j <-> interleaved perm[j].
    perm = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, head_dim)])
    neox, _ = spec.rotary(positions, x[..., perm], x[..., perm], table, "neox")
    np.testing.assert_allclose(neox, out[..., perm], atol=1e-6)

    # Relative: <rot(q, m), rot(k, n)> depends on m - n only.
    q, k = randn(rng, 1, 1, head_dim), randn(rng, 1, 1, head_dim)

    def score(m: int, n: int, style: str) -> float:
        qm, _ = spec.rotary(np.array([m]), q, q, table, style)
        kn, _ = spec.rotary(np.array([n]), k, k, table, style)
        return float(np.sum(qm * kn))

    for style in ("neox", "interleaved"):
        assert score(7, 3, style) == pytest.approx(score(20, 16, style), abs=1e-5)
        assert score(7, 3, style) != pytest.approx(score(7, 4, style), abs=1e-3)


# --- linear ------------------------------------------------------------------------------------


def pd_quantized(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(w.method, pd(w.qweight), pd(w.scales), w.group_size, w.shape)


@pytest.mark.parametrize("n,in_f,out_f", [(1, 64, 48), (9, 576, 192), (4, 128, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_dense(n, in_f, out_f, with_bias):
    rng = np.random.default_rng(in_f + out_f)
    x, w = randn(rng, n, in_f), randn(rng, out_f, in_f)
    bias = randn(rng, out_f) if with_bias else None
    expected = spec.linear(x, w, bias)
    direct = x.astype(np.float64) @ w.astype(np.float64).T + (0 if bias is None else bias)
    np.testing.assert_allclose(expected, direct, rtol=1e-4, atol=1e-4)
    close(
        "linear",
        REFERENCE_OPS["linear"](pd(x), pd(w), None if bias is None else pd(bias)),
        expected,
    )


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("group_size", [-1, 32, 64])
@pytest.mark.parametrize("n", [1, 5])
def test_linear_quantized(method, group_size, n):
    rng = np.random.default_rng(n + group_size)
    x, w = randn(rng, n, 128), randn(rng, 48, 128)
    qw = quantize(w, method, group_size)
    bias = randn(rng, 48)
    expected = spec.linear(x, qw, bias)
    close("linear", REFERENCE_OPS["linear"](pd(x), pd_quantized(qw), pd(bias)), expected)
    # The dequantized matrix, element by element: scale of (row, column // group).
    group = 128 if group_size == -1 else group_size
    deq = np.array(
        [[qw.qweight[o, i] * qw.scales[o, i // group] for i in range(128)] for o in range(48)]
    )
    np.testing.assert_allclose(spec.dequantize(qw), deq, rtol=1e-6)
    # And it stands for w, up to the rounding of quantization.
    step = np.repeat(qw.scales, group, axis=1)
    assert np.all(np.abs(spec.dequantize(qw) - w) <= step / 2 + 1e-6)


def test_linear_fp8_blocks():
    """block_wise_fp8 weights reach the Paddle reference as uint8 bits, partial blocks at both edges."""
    rng = np.random.default_rng(8)
    x, w, bias = randn(rng, 9, 320), randn(rng, 200, 320), randn(rng, 200)
    qw = quantize(w, "block_wise_fp8", 128)
    close("linear", REFERENCE_OPS["linear"](pd(x), pd_quantized(qw), pd(bias)), spec.linear(x, qw, bias))


# --- attention ---------------------------------------------------------------------------------


BATCHES = {
    "prefill": [(0, 7), (0, 3)],
    "chunked": [(5, 4), (12, 6)],
    "decode": [(6, 1), (1, 1), (17, 1)],
    "mixed": [(0, 5), (9, 1), (4, 3), (20, 1), (0, 1), (33, 2)],
    "long": [(0, 150), (37, 70), (100, 1)],
    "idle": [(3, 0), (5, 4), (7, 0), (9, 1), (2, 0)],  # some sequences without new tokens
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("split", [False, True])
def test_attention(batch, block_size, heads, head_dim, split, monkeypatch):
    if split:  # prefills in many chunks, decodes in many length buckets
        monkeypatch.setattr(host_plan, "PREFILL_CHUNK", 3)
        monkeypatch.setattr(host_plan, "DECODE_BUCKET_COST", 0)
    rng = np.random.default_rng(block_size * head_dim + heads[0])
    num_q, num_kv = heads
    meta, (key_cache, value_cache) = build_step(rng, BATCHES[batch], block_size, num_kv, head_dim)
    n = int(meta.query_start_loc[-1])
    q, k, v = (
        randn(rng, n, num_q, head_dim),
        randn(rng, n, num_kv, head_dim),
        randn(rng, n, num_kv, head_dim),
    )
    pd_cache = (pd(key_cache), pd(value_cache))
    scale = head_dim**-0.5
    expected = spec.attention(q, k, v, (key_cache, value_cache), meta, scale)
    actual = REFERENCE_OPS["attention"](pd(q), pd(k), pd(v), pd_cache, meta, scale)
    close("attention", actual, expected)
    np.testing.assert_array_equal(pd_cache[0].numpy(), key_cache)
    np.testing.assert_array_equal(pd_cache[1].numpy(), value_cache)


def test_decode_length_buckets():
    lengths = np.array([10, 11, 12, 1000, 1001])
    assert host_plan.length_buckets(lengths) == [slice(0, 3), slice(3, 5)]
    assert host_plan.length_buckets(np.array([5, 6, 7])) == [slice(0, 3)]
    assert host_plan.length_buckets(np.array([300])) == [slice(0, 1)]


def no_new_tokens(context_lens: list[int], block_size: int = 4) -> AttentionMetadata:
    """A step in which no sequence has a new token (none at all when ``context_lens`` is empty)."""
    blocks = max([-(-c // block_size) for c in context_lens], default=1)
    tables = np.arange(len(context_lens) * blocks, dtype=np.int64).reshape(-1, blocks)
    return AttentionMetadata(
        query_start_loc=np.zeros(len(context_lens) + 1, dtype=np.int64),
        seq_lens=np.array(context_lens, dtype=np.int64),
        context_lens=np.array(context_lens, dtype=np.int64),
        block_tables=tables,
        slot_mapping=np.zeros(0, dtype=np.int64),
        block_size=block_size,
    )


@pytest.mark.parametrize("context_lens", [[3, 9], []], ids=["idle", "no-sequences"])
def test_attention_on_a_step_without_new_tokens(context_lens):
    """Nothing to attend: an empty ``[0, Hq, D]`` result in q's dtype, the cache untouched."""
    rng = np.random.default_rng(15)
    meta = no_new_tokens(context_lens)
    cache = (randn(rng, 16, 2, 8), randn(rng, 16, 2, 8))
    q, k, v = (np.zeros((0, h, 8), np.float32) for h in (4, 2, 2))
    pd_cache = (pd(cache[0]), pd(cache[1]))
    expected = spec.attention(q, k, v, (cache[0].copy(), cache[1].copy()), meta, 0.5)
    assert expected.shape == (0, 4, 8)
    for dtype in ("float32", "float16"):
        actual = REFERENCE_OPS["attention"](pd(q).astype(dtype), pd(k), pd(v), pd_cache, meta, 0.5)
        assert actual.shape == [0, 4, 8] and actual.dtype == getattr(paddle, dtype)
        close("attention", actual.astype("float32"), expected)
    np.testing.assert_array_equal(pd_cache[0].numpy(), cache[0])
    np.testing.assert_array_equal(pd_cache[1].numpy(), cache[1])


def test_attention_reuses_step_metadata_across_layers():
    rng = np.random.default_rng(3)
    meta, _ = build_step(rng, BATCHES["mixed"], 4, 2, 32)
    n = int(meta.query_start_loc[-1])
    for layer in range(3):
        _, cache = build_step(np.random.default_rng(layer), BATCHES["mixed"], 4, 2, 32)
        q, k, v = randn(rng, n, 6, 32), randn(rng, n, 2, 32), randn(rng, n, 2, 32)
        pd_cache = (pd(cache[0]), pd(cache[1]))
        actual = REFERENCE_OPS["attention"](pd(q), pd(k), pd(v), pd_cache, meta, 0.2)
        close("attention", actual, spec.attention(q, k, v, cache, meta, 0.2))
        assert len(meta.device) == 1  # built by the first layer, reused by the others


def test_attention_float16_cache():
    rng = np.random.default_rng(4)
    meta, (key_cache, value_cache) = build_step(rng, BATCHES["mixed"], 16, 2, 64)
    key_cache, value_cache = key_cache.astype(np.float16), value_cache.astype(np.float16)
    n = int(meta.query_start_loc[-1])
    q, k, v = randn(rng, n, 4, 64), randn(rng, n, 2, 64), randn(rng, n, 2, 64)
    pd_cache = (pd(key_cache), pd(value_cache))
    expected = spec.attention(q, k, v, (key_cache, value_cache), meta, 0.125)
    close(
        "attention",
        REFERENCE_OPS["attention"](pd(q), pd(k), pd(v), pd_cache, meta, 0.125),
        expected,
    )
    np.testing.assert_array_equal(pd_cache[0].numpy(), key_cache)


def dense_causal_attention(q, k, v, scale):
    """softmax(q k^T * scale + causal mask) v per query head, in float64, no cache at all."""
    length, num_q, _ = q.shape
    group = num_q // k.shape[1]
    out = np.zeros(q.shape)
    for h in range(num_q):
        scores = q[:, h].astype(np.float64) @ k[:, h // group].T.astype(np.float64) * scale
        scores[np.triu_indices(length, 1)] = -np.inf
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out


def test_attention_spec_equals_dense_causal_attention():
    """One sequence fed as prefill chunk, chunk, then decodes (beside another sequence that
    changes each step) gives exactly the dense causal attention over the whole sequence."""
    rng = np.random.default_rng(5)
    length, num_q, num_kv, head_dim, bs = 23, 6, 2, 16, 4
    q, k, v = (
        randn(rng, length, num_q, head_dim),
        randn(rng, length, num_kv, head_dim),
        randn(rng, length, num_kv, head_dim),
    )
    num_blocks = 32
    table = rng.permutation(num_blocks)[:8]
    other_table = rng.permutation(np.setdiff1d(np.arange(num_blocks), table))[:8]
    cache = (
        randn(rng, num_blocks * bs, num_kv, head_dim),
        randn(rng, num_blocks * bs, num_kv, head_dim),
    )
    chunks = [(0, 9), (9, 17), *[(p, p + 1) for p in range(17, length)]]
    outputs = []
    other_new = 2  # new tokens of a neighbour sequence sharing every step

    def noise(heads: int) -> np.ndarray:
        return randn(rng, other_new, heads, head_dim)

    for step, (start, end) in enumerate(chunks):
        other_ctx = step
        other_pos = np.arange(other_ctx, other_ctx + other_new)
        meta = AttentionMetadata(
            query_start_loc=np.array([0, other_new, other_new + end - start]),
            seq_lens=np.array([other_ctx + other_new, end]),
            context_lens=np.array([other_ctx, start]),
            block_tables=np.stack([other_table, table]),
            slot_mapping=np.concatenate(
                [
                    other_table[other_pos // bs] * bs + other_pos % bs,
                    table[np.arange(start, end) // bs] * bs + np.arange(start, end) % bs,
                ]
            ),
            block_size=bs,
        )
        out = spec.attention(
            np.concatenate([noise(num_q), q[start:end]]),
            np.concatenate([noise(num_kv), k[start:end]]),
            np.concatenate([noise(num_kv), v[start:end]]),
            cache,
            meta,
            0.3,
        )
        outputs.append(out[other_new:])
    np.testing.assert_allclose(
        np.concatenate(outputs), dense_causal_attention(q, k, v, 0.3), rtol=1e-4, atol=1e-5
    )


# --- moe ---------------------------------------------------------------------------------------


def make_experts(rng, num_experts, hidden, inter):
    gate_up = [randn(rng, 2 * inter, hidden) * 0.3 for _ in range(num_experts)]
    down = [randn(rng, hidden, inter) * 0.3 for _ in range(num_experts)]
    return gate_up, down


def expert(x, gate_up, down):
    h = x.astype(np.float64) @ gate_up.T
    inter = h.shape[-1] // 2
    return (h[..., :inter] / (1 + np.exp(-h[..., :inter])) * h[..., inter:]) @ down.T


MOE_CASES = list(
    itertools.product(
        [1, 6],  # tokens
        [(4, 1), (8, 2), (8, 3)],  # experts, top_k
        ["softmax", "sigmoid"],
        [False, True],  # correction bias
        [False, True],  # renormalize
    )
)


@pytest.mark.parametrize("n,experts,scoring,with_bias,renormalize", MOE_CASES)
def test_moe(n, experts, scoring, with_bias, renormalize):
    num_experts, top_k = experts
    rng = np.random.default_rng(n * 10 + num_experts + top_k)
    hidden, inter = 32, 24
    x, router = randn(rng, n, hidden), randn(rng, num_experts, hidden)
    gate_up, down = make_experts(rng, num_experts, hidden, inter)
    bias = randn(rng, num_experts) if with_bias else None
    expected = spec.moe(x, router, gate_up, down, top_k, scoring, renormalize, bias)
    actual = REFERENCE_OPS["moe"](
        pd(x),
        pd(router),
        [pd(w) for w in gate_up],
        [pd(w) for w in down],
        top_k,
        scoring,
        renormalize,
        None if bias is None else pd(bias),
    )
    close("moe", actual, expected)


def test_moe_quantized_experts():
    rng = np.random.default_rng(6)
    x, router = randn(rng, 5, 64), randn(rng, 4, 64)
    gate_up, down = make_experts(rng, 4, 64, 32)
    qgu = [quantize(w, "wint8", 32) for w in gate_up]
    qd = [quantize(w, "wint4", -1) for w in down]
    expected = spec.moe(x, router, qgu, qd, 2)
    actual = REFERENCE_OPS["moe"](
        pd(x), pd(router), [pd_quantized(w) for w in qgu], [pd_quantized(w) for w in qd], 2
    )
    close("moe", actual, expected)


def test_moe_router_ties_go_to_the_lower_expert():
    """Experts tied on score (+ correction bias) go to the lower expert id, as the spec says."""
    rng = np.random.default_rng(16)
    x, router = randn(rng, 3, 8), np.zeros((16, 8), np.float32)
    # A zero router scores every expert alike: the lowest ids win, best first.
    ids, weights = pd_ops.route(pd(x), pd(router), 4)
    np.testing.assert_array_equal(ids.numpy(), [[0, 1, 2, 3]] * 3)
    np.testing.assert_array_equal(ids.numpy(), spec.route(x, router, 4)[0])
    close("moe", weights, np.full((3, 4), 0.25, np.float32))
    # Tied through the correction bias: 9 and 5 above the rest, then 12 above the others.
    bias = np.zeros(16, np.float32)
    bias[[9, 5, 12]] = [1.0, 1.0, 0.5]
    ids, _ = pd_ops.route(pd(x), pd(router), 3, "sigmoid", True, pd(bias))
    np.testing.assert_array_equal(ids.numpy(), [[5, 9, 12]] * 3)
    np.testing.assert_array_equal(ids.numpy(), spec.route(x, router, 3, "sigmoid", True, bias)[0])
    # And the op itself runs the experts the spec's router chose.
    gate_up, down = make_experts(rng, 16, 8, 6)
    for top_k, b in [(4, None), (3, bias)]:
        actual = REFERENCE_OPS["moe"](
            pd(x), pd(router), [pd(w) for w in gate_up], [pd(w) for w in down], top_k,
            "sigmoid", True, None if b is None else pd(b),
        )
        close("moe", actual, spec.moe(x, router, gate_up, down, top_k, "sigmoid", True, b))


def test_moe_spec_from_first_principles():
    rng = np.random.default_rng(7)
    hidden, inter, num_experts = 16, 8, 4
    x, router = randn(rng, 3, hidden), randn(rng, num_experts, hidden)
    gate_up, down = make_experts(rng, num_experts, hidden, inter)
    logits = x.astype(np.float64) @ router.T
    outputs = np.stack([expert(x, gate_up[e], down[e]) for e in range(num_experts)], axis=1)

    # Every expert chosen, softmax, renormalised: the softmax-weighted sum of all experts.
    weights = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    dense = np.einsum("ne,neh->nh", weights, outputs)
    np.testing.assert_allclose(
        spec.moe(x, router, gate_up, down, num_experts), dense, rtol=1e-4, atol=1e-5
    )

    # A huge correction bias forces an expert's choice, but its weight stays the unbiased score.
    bias = np.array([0, 0, 100, 0], dtype=np.float32)
    sig = 1 / (1 + np.exp(-logits))
    got = spec.moe(x, router, gate_up, down, 1, "sigmoid", False, bias)
    np.testing.assert_allclose(got, sig[:, 2:3] * outputs[:, 2], rtol=1e-4, atol=1e-5)
    # Renormalised top-1: the weight becomes exactly 1.
    got = spec.moe(x, router, gate_up, down, 1, "sigmoid", True, bias)
    np.testing.assert_allclose(got, outputs[:, 2], rtol=1e-4, atol=1e-5)


# --- sample ------------------------------------------------------------------------------------




def both(logits: np.ndarray, batch: SamplingBatch):
    return spec.sample(logits, batch), REFERENCE_OPS["sample"](pd(logits), batch)


def assert_same_output(a, b) -> None:
    np.testing.assert_array_equal(a.token_ids, b.token_ids)
    np.testing.assert_array_equal(a.ranks, b.ranks)
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    close("sample", b.logprobs, a.logprobs)
    close("sample", b.top_logprobs, a.top_logprobs)


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("num_rows,vocab", [(1, 10), (4, 1000), (3, 49152)])
def test_sample_greedy_is_argmax(num_rows, vocab):
    logits = randn(np.random.default_rng(vocab), num_rows, vocab) * 3
    expected, actual = both(logits, make_sampling_batch(num_rows, temperature=[0.0] * num_rows))
    for out in (expected, actual):
        np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
        np.testing.assert_array_equal(out.ranks, np.ones(num_rows))
        assert out.top_ids.shape == out.top_logprobs.shape == (num_rows, 0)
        np.testing.assert_allclose(
            out.logprobs, log_softmax64(logits).max(axis=1), **TOLERANCES["sample"]
        )
    assert_same_output(expected, actual)


def random_batch(rng: np.random.Generator, num_rows: int, vocab: int) -> SamplingBatch:
    def pick(options: list) -> list:
        return [options[i] for i in rng.integers(0, len(options), num_rows)]

    def tokens(most: int) -> list[np.ndarray]:
        return [rng.integers(0, vocab, rng.integers(0, most)) for _ in range(num_rows)]

    return make_sampling_batch(
        num_rows,
        temperature=pick([0.0, 0.3, 1.0, 1.7]),
        top_k=pick([0, 1, 5, 40, vocab]),
        top_p=pick([1.0, 0.9, 0.5, 0.05]),
        min_p=pick([0.0, 0.0, 0.05, 0.3]),
        presence_penalty=pick([0.0, 0.5, -0.3]),
        frequency_penalty=pick([0.0, 0.2]),
        repetition_penalty=pick([1.0, 1.3, 0.8]),
        seeds=rng.integers(0, 2**31, num_rows),
        steps=rng.integers(0, 100, num_rows),
        prompt_token_ids=tokens(12),
        output_token_ids=tokens(20),
        suppress_token_ids=tokens(4),
        num_logprobs=int(rng.choice([0, 1, 5])),
    )


@pytest.mark.parametrize("seed", range(8))
def test_sample_matches_spec_on_mixed_batches(seed):
    rng = np.random.default_rng(seed)
    num_rows, vocab = int(rng.integers(1, 12)), int(rng.choice([50, 700, 5000]))
    logits = randn(rng, num_rows, vocab) * 2
    assert_same_output(*both(logits, random_batch(rng, num_rows, vocab)))


def test_sample_logprobs_ranks_and_top_ids_from_first_principles():
    rng = np.random.default_rng(8)
    logits = randn(rng, 6, 300) * 2
    batch = make_sampling_batch(6, temperature=[0, 1, 1, 0.5, 2, 0], num_logprobs=4)
    raw = log_softmax64(logits)
    for out in both(logits, batch):
        rows = np.arange(6)
        np.testing.assert_allclose(out.logprobs, raw[rows, out.token_ids], **TOLERANCES["sample"])
        np.testing.assert_array_equal(
            out.ranks, 1 + (raw > raw[rows, out.token_ids][:, None]).sum(1)
        )
        np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=1)[:, :4])
        np.testing.assert_allclose(
            out.top_logprobs, np.sort(raw, axis=1)[:, ::-1][:, :4], **TOLERANCES["sample"]
        )


def test_sample_rank_ties_share_the_worse_rank():
    logits = np.array([[1.0, 3.0, 3.0, 0.0]], dtype=np.float32)
    for out in both(logits, make_sampling_batch(1, temperature=[0.0], num_logprobs=2)):
        assert out.token_ids[0] == 1
        assert out.ranks[0] == 2
        np.testing.assert_array_equal(out.top_ids, [[1, 2]])


def test_sample_top_ids_ties_go_to_the_lower_id():
    """Tied logits in the top logprobs, inside them and at their edge, go to the lower id."""
    logits = np.array(
        [[2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 1.0], [1.0, 3.0, 3.0, 0.0], [4.0, 1.0, 3.0, 2.0]],
        dtype=np.float32,
    )
    for temperature in (0.0, 1.0):
        batch = make_sampling_batch(4, temperature=[temperature] * 4, num_logprobs=2)
        expected, actual = both(logits, batch)
        np.testing.assert_array_equal(expected.top_ids, [[0, 1], [1, 2], [1, 2], [0, 2]])
        assert_same_output(expected, actual)
    # Over a large vocabulary: a flat row, and one whose runner-up ties with every other token.
    flat = np.zeros((2, 5000), np.float32)
    flat[1, 4999] = 1.0
    expected, actual = both(flat, make_sampling_batch(2, temperature=[0.0, 0.0], num_logprobs=3))
    np.testing.assert_array_equal(expected.top_ids, [[0, 1, 2], [4999, 0, 1]])
    assert_same_output(expected, actual)


# --- token_logprobs -----------------------------------------------------------------------------


def scored(logits: np.ndarray, token_ids: np.ndarray, k: int):
    return spec.token_logprobs(logits, token_ids, k), REFERENCE_OPS["token_logprobs"](pd(logits), pd(token_ids), k)


@pytest.mark.parametrize("num_rows, vocab, k", [(1, 10, 0), (7, 1000, 3), (3, 49152, 20)])
def test_token_logprobs_from_first_principles(num_rows, vocab, k):
    rng = np.random.default_rng(vocab + k)
    logits = randn(rng, num_rows, vocab) * 3
    ids = rng.integers(0, vocab, num_rows).astype(np.int64)
    raw = log_softmax64(logits)
    rows = np.arange(num_rows)
    for out in scored(logits, ids, k):
        np.testing.assert_array_equal(out.token_ids, ids)
        np.testing.assert_allclose(out.logprobs, raw[rows, ids], **TOLERANCES["token_logprobs"])
        np.testing.assert_array_equal(out.ranks, 1 + (raw > raw[rows, ids][:, None]).sum(1))
        np.testing.assert_array_equal(out.top_ids, np.argsort(-raw, axis=1)[:, :k])
        np.testing.assert_allclose(out.top_logprobs, np.sort(raw, axis=1)[:, ::-1][:, :k],
                                   **TOLERANCES["token_logprobs"])
    assert_same_output(*scored(logits, ids, k))


def test_token_logprobs_report_what_sample_reports_of_its_tokens():
    """Given the tokens ``sample`` drew, the scores are its logprobs, ranks and top logprobs,
    whatever filters and penalties steered the draw (both report the raw distribution)."""
    rng = np.random.default_rng(4)
    logits = randn(rng, 9, 700) * 2
    batch = random_batch(rng, 9, 700)
    batch.num_logprobs = 4
    drawn = spec.sample(logits, batch)
    for out in scored(logits, drawn.token_ids, 4):
        assert_same_output(drawn, out)


def test_token_logprobs_ties():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=np.float32)
    for out in scored(logits, np.array([2, 3]), 2):
        np.testing.assert_array_equal(out.ranks, [2, 4])  # ties share the worse rank
        np.testing.assert_array_equal(out.top_ids, [[1, 2], [0, 1]])  # and go to the lower id


def test_top_k_ties_unresolved():
    """A topk answer stands unless a tie touches it: inside it, or at its edge."""
    unresolved = host_plan.top_k_ties_unresolved
    assert not unresolved(np.array([[3.0, 2.0], [5.0, 1.0]]), np.array([2, 2]))
    assert unresolved(np.array([[3.0, 2.0], [5.0, 5.0]]), np.array([2, 2]))  # inside
    assert unresolved(np.array([[3.0, 2.0], [5.0, 1.0]]), np.array([2, 3]))  # at the edge


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    rng = np.random.default_rng(9)
    vocab = 400
    row = randn(rng, 1, vocab)
    params = dict(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)
    alone = make_sampling_batch(1, **{k: [v] for k, v in params.items()}, seeds=[1234], steps=[7])
    others = random_batch(rng, 5, vocab)
    for impl in (spec.sample, lambda x, b: REFERENCE_OPS["sample"](pd(x), b)):
        token = impl(row, alone).token_ids[0]
        assert impl(row, alone).token_ids[0] == token
        for position in (0, 2, 5):
            logits = np.insert(randn(rng, 5, vocab), position, row[0], axis=0)
            batch = insert_row(others, alone, position)
            assert impl(logits, batch).token_ids[position] == token
    # The step is part of the seed: a flat distribution gives different tokens at other steps.
    flat = np.zeros((1, vocab), np.float32)
    tokens = {
        spec.sample(flat, make_sampling_batch(1, seeds=[1234], steps=[s])).token_ids[0] for s in range(10)
    }
    assert len(tokens) > 5


def insert_row(batch: SamplingBatch, row: SamplingBatch, position: int) -> SamplingBatch:
    fields = {}
    for name, value in vars(batch).items():
        if isinstance(value, np.ndarray):
            fields[name] = np.insert(value, position, getattr(row, name)[0])
        elif isinstance(value, list):
            fields[name] = value[:position] + [getattr(row, name)[0]] + value[position:]
        else:
            fields[name] = value
    return SamplingBatch(**fields)


def batch_row(batch: SamplingBatch, i: int) -> SamplingBatch:
    fields = {}
    for name, value in vars(batch).items():
        fields[name] = value[i : i + 1] if isinstance(value, (np.ndarray, list)) else value
    return SamplingBatch(**fields)


def allowed_tokens(logits: np.ndarray, temperature, top_k, top_p, min_p) -> set[int]:
    """Written out from the words of the contract, on a float64 distribution."""
    order = np.argsort(-logits)
    probs = np.exp((logits - logits.max()) / temperature)
    keep = np.ones(len(logits), bool)
    if 0 < top_k < len(logits):
        keep[order[top_k:]] = False
    p = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum()
    if top_p < 1:
        mass, nucleus = 0.0, []
        for t in order:
            if mass >= top_p:
                break
            nucleus.append(t)
            mass += p[t]
        keep &= np.isin(np.arange(len(logits)), nucleus)
    p = np.where(keep, p, 0)
    if min_p > 0:
        keep &= p >= min_p * p.max()
    return set(np.flatnonzero(keep))


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [
        (1.0, 5, 1.0, 0.0),
        (1.0, 0, 0.6, 0.0),
        (0.7, 0, 1.0, 0.2),
        (1.3, 20, 0.8, 0.05),
        (1.0, 1, 1.0, 0.0),
    ],
)
def test_sample_only_picks_allowed_tokens(temperature, top_k, top_p, min_p):
    rng = np.random.default_rng(10)
    vocab, num_rows = 60, 300
    logits = np.repeat(randn(rng, 1, vocab) * 1.5, num_rows, axis=0)
    allowed = allowed_tokens(logits[0].astype(np.float64), temperature, top_k, top_p, min_p)
    batch = make_sampling_batch(
        num_rows,
        temperature=[temperature] * num_rows,
        top_k=[top_k] * num_rows,
        top_p=[top_p] * num_rows,
        min_p=[min_p] * num_rows,
    )
    expected, actual = both(logits, batch)
    np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
    drawn = set(expected.token_ids.tolist())
    assert drawn <= allowed
    assert len(drawn) == min(len(allowed), len(drawn)) and (len(allowed) == 1 or len(drawn) > 1)


def test_sample_draws_follow_the_distribution():
    """The exponential race picks each token with its probability (4000 seeded rows)."""
    probs = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
    num_rows = 4000
    logits = np.repeat(np.log(np.maximum(probs, 1e-30))[None].astype(np.float32), num_rows, 0)
    for out in both(logits, make_sampling_batch(num_rows)):
        freq = np.bincount(out.token_ids, minlength=5) / num_rows
        np.testing.assert_allclose(freq, probs, atol=0.03)
        assert freq[4] == 0


def chi2_limit(df: int) -> float:
    """The chi-square statistic exceeded with probability 1e-4 (Wilson-Hilferty)."""
    a = 2 / (9 * df)
    return df * (1 - a + 3.719 * np.sqrt(a)) ** 3


def race(seeds, steps, probs: np.ndarray) -> np.ndarray:
    """The token each (seed, step) row draws from ``probs`` with the contract's noise."""
    noise = spec.sampling_noise(np.asarray(seeds), np.asarray(steps), len(probs))
    return np.argmax(probs.astype(np.float32)[None, :] / noise, axis=1)


def test_sampling_noise_definition():
    """Pinned values, so that a change of the definition (which every backend must follow) is
    never silent; and the noise is a function of (seed, step, token id) alone."""
    key0, key1 = spec.sampling_keys([0, 1, 2**40 + 5], [0, 0, 123])
    np.testing.assert_array_equal(key0, [2008210422, 3311306429, 2120072663])
    np.testing.assert_array_equal(key1, [2228315529, 2397809054, 1469978618])
    np.testing.assert_allclose(
        spec.sampling_noise([0], [0], 4), [[1.6303279, 4.85078, 1.308352, 1.2291493]], rtol=1e-6
    )
    np.testing.assert_allclose(
        spec.sampling_noise([2**62 + 12345], [2**31 + 7], 3),
        [[0.9373783, 2.0271084, 0.0366523]],
        rtol=1e-6,
    )
    # Element-wise: any subset of tokens, in any order, gets the same values.
    seeds, steps = np.array([3, 2**63 - 1]), np.array([5, 0])
    full = spec.sampling_noise(seeds, steps, 5000)
    key0, key1 = spec.sampling_keys(seeds, steps)
    ids = np.array([4999, 0, 17, 4096])
    np.testing.assert_array_equal(
        spec.counter_noise(key0[:, None], key1[:, None], ids[None, :]), full[:, ids]
    )
    assert full.dtype == np.float32 and np.all(full > 0) and np.all(np.isfinite(full))
    # host_plan.noise (the Paddle reference's) is this function.
    batch = make_sampling_batch(3, seeds=[9, 8, 7], steps=[1, 2, 3])
    np.testing.assert_array_equal(
        host_plan.noise(batch, np.array([2, 0]), 300),
        spec.sampling_noise(np.array([7, 9]), np.array([3, 1]), 300),
    )


def test_sampling_noise_is_exponential():
    noise = spec.sampling_noise(np.arange(32), np.zeros(32, np.int64), 32768).ravel()
    assert abs(noise.mean() - 1) < 0.01 and abs(noise.var() - 1) < 0.02
    for q in (0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999):
        # Fraction below the Exponential(1) quantile, within 5 binomial standard deviations.
        below = np.mean(noise < -np.log1p(-q))
        assert abs(below - q) < 5 * np.sqrt(q * (1 - q) / len(noise)), q
    # Neighbouring tokens are uncorrelated.
    rows = noise.reshape(32, -1)
    assert abs(np.corrcoef(rows[:, :-1].ravel(), rows[:, 1:].ravel())[0, 1]) < 0.005


def test_sampled_tokens_follow_the_distribution_over_seeds_and_steps():
    """Chi-square of the race's draws against the probabilities, across seeds, across the
    steps of one seed, and across seeds that differ only in their high 32 bits."""
    probs = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    n = 40000
    ids = np.arange(n, dtype=np.int64)
    for seeds, steps in [(ids, 0 * ids), (0 * ids + 7, ids), (ids << 32, 0 * ids)]:
        counts = np.bincount(race(seeds, steps, probs), minlength=len(probs))
        expected = probs * n
        assert np.sum((counts - expected) ** 2 / expected) < chi2_limit(len(probs) - 1)


@pytest.mark.parametrize(
    "first,second",
    [
        ("step", "step + 1"),
        ("seed", "seed + 1"),
        ("seed", "seed + 2**32"),  # the seed's high word counts
        ("step", "seed"),  # seed and step do not enter symmetrically
    ],
)
def test_draws_of_neighbouring_seeds_and_steps_are_independent(first, second):
    """Pairs of rows whose (seed, step) differ by one step, one seed, or the high word of the
    seed draw independently: their joint counts over 8 equally likely tokens are uniform."""
    n = 40000
    ids = np.arange(n, dtype=np.int64)
    pairs = {
        ("step", "step + 1"): ((ids, 0 * ids + 3), (ids, 0 * ids + 4)),
        ("seed", "seed + 1"): ((2 * ids, 0 * ids + 3), (2 * ids + 1, 0 * ids + 3)),
        ("seed", "seed + 2**32"): ((ids, 0 * ids + 3), (ids + 2**32, 0 * ids + 3)),
        ("step", "seed"): ((ids, ids + 1), (ids + 1, ids)),
    }[(first, second)]
    uniform = np.full(8, 1 / 8)
    a, b = race(*pairs[0], uniform), race(*pairs[1], uniform)
    joint = np.bincount(a * 8 + b, minlength=64)
    assert np.sum((joint - n / 64) ** 2 / (n / 64)) < chi2_limit(63)


def test_penalties_spec_by_hand():
    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], dtype=np.float32)
    batch = make_sampling_batch(
        1,
        repetition_penalty=[2.0],
        frequency_penalty=[0.5],
        presence_penalty=[0.25],
        prompt_token_ids=[[0, 4]],
        output_token_ids=[[1, 1, 3]],
    )
    # token 0: prompt, positive -> / 2.       token 1: output x2, negative -> * 2, - 2*0.5 - 0.25
    # token 3: output x1, positive -> / 2 - 0.5 - 0.25.   token 4: prompt, negative -> * 2
    expected = [[1.0, -2.0 - 1.0 - 0.25, 0.5, 1.5 - 0.5 - 0.25, -4.0, 1.0]]
    np.testing.assert_allclose(spec.apply_penalties(logits, batch), expected, rtol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_penalties_match_spec(seed):
    rng = np.random.default_rng(seed + 20)
    batch = random_batch(rng, 6, 200)
    logits = randn(rng, 6, 200) * 3
    close("sample", pd_ops.apply_penalties(pd(logits), batch), spec.apply_penalties(logits, batch))


def test_penalties_and_suppression_steer_greedy_choice():
    logits = np.array(
        [[0.1, 2.0, 1.9, 1.0], [0.1, 2.0, 1.9, 1.0], [0.1, 2.0, 1.9, 1.0]], np.float32
    )
    batch = make_sampling_batch(
        3,
        temperature=[0.0] * 3,
        frequency_penalty=[0.0, 0.3, 0.0],
        output_token_ids=[[1], [1], []],
        suppress_token_ids=[[], [], [1, 2]],
    )
    for out in both(logits, batch):
        np.testing.assert_array_equal(out.token_ids, [1, 2, 3])
        np.testing.assert_array_equal(out.ranks, [1, 2, 3])  # ranks are on the raw logits


def test_suppressed_tokens_are_never_sampled():
    rng = np.random.default_rng(11)
    logits = np.repeat(randn(rng, 1, 30), 200, axis=0)
    banned = np.argsort(-logits[0])[:5]
    batch = make_sampling_batch(200, suppress_token_ids=[banned] * 200)
    expected, actual = both(logits, batch)
    np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
    assert not set(expected.token_ids.tolist()) & set(banned.tolist())


def test_tiny_temperature_is_greedy_without_overflow():
    logits = randn(np.random.default_rng(12), 3, 500) * 50
    for out in both(logits, make_sampling_batch(3, temperature=[1e-6] * 3)):
        np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))


@pytest.mark.parametrize(
    "spread,top_p,top_k,width",
    [(6.0, 0.9, 0, 256), (1.5, 0.9, 0, 2048), (0.05, 0.95, 0, 4096), (6.0, 0.9, 100, 100)],
)
def test_top_p_over_a_large_vocabulary(spread, top_p, top_k, width, monkeypatch):
    """The nucleus is found from the top-k survivors, a top-k head widened as needed, or a full
    sort; all give the spec's draw."""
    rng = np.random.default_rng(13)
    vocab, num_rows = 4096, 6
    logits = randn(rng, num_rows, vocab) * spread
    batch = make_sampling_batch(
        num_rows,
        top_p=[top_p] * num_rows,
        top_k=[top_k] * num_rows,
        seeds=rng.integers(0, 1000, num_rows),
    )
    widths = []
    head = pd_ops._nucleus_head
    monkeypatch.setattr(
        pd_ops, "_nucleus_head", lambda *a: widths.append(head(*a).shape[1]) or head(*a)
    )
    assert_same_output(*both(logits, batch))
    assert widths == [width]
    for i in range(num_rows):
        allowed = allowed_tokens(logits[i].astype(np.float64), 1.0, top_k, top_p, 0.0)
        assert spec.sample(logits[i : i + 1], batch_row(batch, i)).token_ids[0] in allowed


# --- structured output's token bitmask (API 1.10) -----------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1003, 49152])
def test_token_bitmask_layout(vocab):
    from fd_core.interfaces.ops import (
        pack_token_bitmask,
        token_bitmask_words,
        unpack_token_bitmask,
    )

    rng = np.random.default_rng(vocab)
    allowed = rng.random((3, vocab)) < 0.3
    allowed[0, vocab - 1] = True
    words = pack_token_bitmask(allowed)
    assert words.dtype == np.int32 and words.shape == (3, token_bitmask_words(vocab))
    np.testing.assert_array_equal(unpack_token_bitmask(words, vocab), allowed)
    # the layout llguidance and xgrammar fill: bit t % 32 of word t // 32, padding bits clear
    for t in np.flatnonzero(allowed[0]):
        assert (int(words[0, t // 32]) >> int(t % 32)) & 1
    last = (vocab - 1) // 32
    assert (int(words[0, last]) & 0xFFFFFFFF) >> ((vocab - 1) % 32 + 1) == 0


def test_sample_keeps_to_the_allowed_tokens():
    from fd_core.interfaces.ops import pack_token_bitmask

    rng = np.random.default_rng(18)
    rows, vocab = 12, 500
    logits = randn(rng, rows, vocab) * 3
    allowed = rng.random((rows, vocab)) < 0.05
    allowed[:, 0] = True
    allowed[0] = False
    allowed[0, 321] = True  # forced
    allowed[1] = True  # no grammar
    params = {"temperature": [0.0, 0.0] + [0.0, 1.0] * 5, "top_k": [0] * 6 + [5] * 6, "seeds": np.arange(rows)}
    free = spec.sample(logits, make_sampling_batch(rows, **params))
    batch = make_sampling_batch(rows, **params)
    batch.allowed_token_bitmask = pack_token_bitmask(allowed)
    for out in both(logits, batch):
        assert all(allowed[i, t] for i, t in enumerate(out.token_ids))
        assert out.token_ids[0] == 321 and out.token_ids[1] == free.token_ids[1]
        greedy = [i for i in range(2, rows) if params["temperature"][i] == 0]
        for i in greedy:
            assert out.token_ids[i] == np.flatnonzero(allowed[i])[np.argmax(logits[i, allowed[i]])]
        # the raw distribution's logprob and top logprobs, as with suppression
        raw = log_softmax64(logits)
        close("sample", out.logprobs, raw[np.arange(rows), out.token_ids].astype(np.float32))


# --- OpenAI's logit_bias (API 1.11) ---------------------------------------------------------------


def kit_bias_case():
    """The conformance kit's logit_bias case: its logits and batch, as the kit makes them."""
    from fd_core.interfaces import Capabilities
    from fd_core.testing import opcases

    (case,) = [c for c in opcases.cases(Capabilities(dtypes={"float32"}), ops={"sample"})
               if c.params["kind"] == "logit_bias"]
    rows, vocab = case.params["rows"], case.params["vocab"]
    rng = opcases._rng(case)
    logits = opcases._randn(rng, rows, vocab, scale=2.0)
    return logits, opcases.sampling_batch(case, rng, rows, vocab, logits)


def test_the_kit_bias_case_tests_what_it_says():
    """Each row of the kit's case turns on the bias as its docstring says, in the spec and both
    references: a flip, a ban, the bias before the repetition penalty, a grammar and a
    suppression that a +100 bias does not lift, and raw logprobs of the unbiased model."""
    from fd_core.interfaces.ops import unpack_token_bitmask
    from fd_core.runtimes.torch import ops as torch_ops

    torch = pytest.importorskip("torch")
    logits, batch = kit_bias_case()
    order = np.argsort(-logits, axis=1, kind="stable")
    best, second = logits[3, order[3, :2]]
    b = batch.logit_bias[3][1][0]
    assert (best + b) / 2 < second < best / 2 + b  # the other order would keep the argmax
    allowed = unpack_token_bitmask(batch.allowed_token_bitmask, logits.shape[1])
    (banned,) = [t for t, v in zip(*batch.logit_bias[5]) if v == 100]
    assert not allowed[5, banned]
    raw = log_softmax64(logits)
    outs = [*both(logits, batch), torch_ops.sample(torch.from_numpy(logits.copy()), batch)]
    for out in outs:
        assert out.token_ids[0] == order[0, 0]  # no bias beside rows with one
        assert out.token_ids[1] == order[1, 4]
        assert out.token_ids[2] == order[2, 1]
        assert out.token_ids[3] == order[3, 1]
        assert allowed[5, out.token_ids[5]]
        assert out.token_ids[6] not in batch.suppress_token_ids[6]
        close("sample", out.logprobs, raw[np.arange(len(logits)), out.token_ids].astype(np.float32))
        assert_same_output(outs[0], out)


def test_logit_bias_on_greedy_and_random_rows():
    """A bias moves the greedy choice and the distribution a row draws from; rows without one,
    and a batch whose rows all have none, sample as without the field."""
    rng = np.random.default_rng(11)
    rows, vocab = 6, 400
    logits = randn(rng, rows, vocab) * 3
    params = {"temperature": [0.0, 0.0, 1.0, 1.0, 0.0, 0.7], "top_k": [0, 0, 0, 20, 0, 0], "seeds": np.arange(rows)}
    plain = spec.sample(logits, make_sampling_batch(rows, **params))
    nothing = make_sampling_batch(rows, logit_bias=[([], [])] * rows, **params)
    for out in both(logits, nothing):
        assert_same_output(plain, out)
    target, best = 123, np.argsort(-logits[4])
    bias = [([target], [100.0]), ([], []), ([target], [100.0]), ([target], [100.0]), (best[:3], [-100.0] * 3),
            ([], [])]
    batch = make_sampling_batch(rows, logit_bias=bias, **params)
    for out in both(logits, batch):
        assert list(out.token_ids[[0, 2, 3]]) == [target] * 3  # +100 all but forces it, top-k included
        assert out.token_ids[4] == best[3]  # the three best banned
        assert out.token_ids[1] == plain.token_ids[1] and out.token_ids[5] == plain.token_ids[5]
        assert out.ranks[0] == np.sum(logits[0] >= logits[0, target])  # ranked in the raw distribution


def test_logit_bias_leaves_the_logits_alone():
    logits = randn(np.random.default_rng(2), 2, 50)
    batch = make_sampling_batch(2, temperature=[0.0, 0.0], logit_bias=[([3], [50.0]), ([], [])])
    tensor = pd(logits)
    REFERENCE_OPS["sample"](tensor, batch)
    np.testing.assert_array_equal(tensor.numpy(), logits)


def test_logit_bias_ids_outside_the_vocabulary_raise():
    batch = make_sampling_batch(2, logit_bias=[([], []), ([50], [1.0])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        host_plan.biases(batch, 50)
