"""The PyTorch runtime (``fd_core.runtimes.torch``): its reference ops against the NumPy
specification on the shape grids of ``test_op_spec.py``, its sampling against the Paddle
reference token for token, ``TorchMemory`` against the Memory protocol, and a tiny Llama run end
to end on both runtimes. Everything runs on the CPU build of torch."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fd_core.interfaces import Memory  # noqa: E402
from fd_core.interfaces.ops import (  # noqa: E402
    OP_SPECS,
    AttentionMetadata,
    QuantizedWeight,
    SamplingBatch,
)
from fd_core.quantization.quantize import quantize  # noqa: E402
from fd_core.runtimes import host_plan  # noqa: E402
from fd_core.runtimes.torch import REFERENCE_OPS, TorchMemory  # noqa: E402
from fd_core.runtimes.torch import memory as th_memory  # noqa: E402
from fd_core.runtimes.torch import ops as th_ops  # noqa: E402
from fd_core.testing import spec  # noqa: E402
from fd_core.testing.batches import make_sampling_batch
from fd_core.testing.opcases import attention_step as build_step  # noqa: E402
from fd_core.testing.spec import TOLERANCES  # noqa: E402


def th(a) -> torch.Tensor:
    """A torch copy of a host array (never sharing its memory: ops write caches in place)."""
    return torch.from_numpy(np.array(a))


def host(t) -> np.ndarray:
    t = t.detach().cpu()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def close(name: str, actual, expected) -> None:
    actual = host(actual) if isinstance(actual, torch.Tensor) else actual
    np.testing.assert_allclose(actual, expected, **TOLERANCES[name])


def randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def paddle_runtime():
    """The Paddle runtime, for the comparisons that need it."""
    return pytest.importorskip("fd_core.runtimes.paddle")


def test_every_op_has_a_torch_reference():
    # token_logprobs is optional for a backend, which falls back to the reference's
    assert set(REFERENCE_OPS) == {name for name, s in OP_SPECS.items() if not s.optional} | {"token_logprobs"}
    assert set(OP_SPECS) == set(TOLERANCES)


def test_registry_resolves_the_torch_runtime():
    from fd_core.plugins.registry import BackendRegistry

    assert BackendRegistry(entry_points=[]).reference_ops("torch") == REFERENCE_OPS


def imported(path: Path) -> list[str]:
    """Every module name a source file imports."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_the_torch_runtime_does_not_import_paddle():
    for path in Path(th_ops.__file__).parent.glob("*.py"):
        names = imported(path)
        assert not any(n.split(".")[0] == "paddle" or ".paddle" in n for n in names), path


def test_the_shared_host_plan_imports_no_runtime():
    """Both runtimes' host-side planning: NumPy only, neither tensor library nor runtime."""
    for name in imported(Path(host_plan.__file__)):
        assert name.split(".")[0] not in ("paddle", "torch"), name
        assert not name.startswith(("fd_core.runtimes.paddle", "fd_core.runtimes.torch")), name


# --- embedding, rms_norm, silu_and_mul, rotary, linear ------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedding(n, dtype):
    rng = np.random.default_rng(n)
    weight = th(randn(rng, 50, 24)).to(getattr(torch, dtype))
    ids = rng.integers(0, 50, n).astype(np.int64)
    out = REFERENCE_OPS["embedding"](weight, th(ids))
    assert out.dtype == weight.dtype
    close("embedding", out, spec.embedding(host(weight), ids))


@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (2, 3, 128)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(shape, with_residual):
    rng = np.random.default_rng(len(shape) + shape[-1])
    x, weight = randn(rng, *shape), randn(rng, shape[-1])
    residual = randn(rng, *shape) if with_residual else None
    expected = spec.rms_norm(x, weight, 1e-6, residual)
    actual = REFERENCE_OPS["rms_norm"](th(x), th(weight), 1e-6, None if residual is None else th(residual))
    for a, e in zip(*((actual, expected) if with_residual else ((actual,), (expected,)))):
        close("rms_norm", a, e)


def test_rms_norm_keeps_a_half_dtype_and_sums_in_float32():
    rng = np.random.default_rng(3)
    x, residual, weight = randn(rng, 4, 64), randn(rng, 4, 64), randn(rng, 64)
    y, summed = REFERENCE_OPS["rms_norm"](
        th(x).bfloat16(), th(weight), 1e-6, th(residual).bfloat16()
    )
    assert y.dtype == summed.dtype == torch.bfloat16
    xb, rb = host(th(x).bfloat16()), host(th(residual).bfloat16())
    ey, es = spec.rms_norm(xb, weight, 1e-6, rb)
    np.testing.assert_allclose(host(summed), es, rtol=2**-8, atol=1e-6)
    np.testing.assert_allclose(host(y), ey, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("n,inter", [(1, 8), (5, 64), (33, 1536)])
def test_silu_and_mul(n, inter):
    x = randn(np.random.default_rng(inter), n, 2 * inter)
    close("silu_and_mul", REFERENCE_OPS["silu_and_mul"](th(x)), spec.silu_and_mul(x))


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
    aq, ak = REFERENCE_OPS["rotary"](th(positions), th(q), th(k), th(table), style)
    close("rotary", aq, eq)
    close("rotary", ak, ek)


def test_rotary_rejects_an_unknown_style():
    x = th(np.zeros((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match="rotary style"):
        REFERENCE_OPS["rotary"](th(np.array([0])), x, x, th(cos_sin_table(4, 4)), "gptj")


def th_quantized(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(w.method, th(w.qweight), th(w.scales), w.group_size, w.shape)


@pytest.mark.parametrize("n,in_f,out_f", [(1, 64, 48), (9, 576, 192), (4, 128, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_dense(n, in_f, out_f, with_bias):
    rng = np.random.default_rng(in_f + out_f)
    x, w = randn(rng, n, in_f), randn(rng, out_f, in_f)
    bias = randn(rng, out_f) if with_bias else None
    actual = REFERENCE_OPS["linear"](th(x), th(w), None if bias is None else th(bias))
    close("linear", actual, spec.linear(x, w, bias))


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("group_size", [-1, 32, 64])
@pytest.mark.parametrize("n", [1, 5])
def test_linear_quantized(method, group_size, n):
    rng = np.random.default_rng(n + group_size)
    x, w, bias = randn(rng, n, 128), randn(rng, 48, 128), randn(rng, 48)
    qw = quantize(w, method, group_size)
    close("linear", REFERENCE_OPS["linear"](th(x), th_quantized(qw), th(bias)), spec.linear(x, qw, bias))
    close("linear", th_ops.dequantize(th_quantized(qw)), spec.dequantize(qw))


@pytest.mark.parametrize("n", [1, 37])
def test_linear_fp8_blocks(n):
    """block_wise_fp8 weights reach the reference as uint8 bits, partial blocks at both edges."""
    rng = np.random.default_rng(n)
    x, w, bias = randn(rng, n, 320), randn(rng, 200, 320), randn(rng, 200)
    qw = quantize(w, "block_wise_fp8", 128)
    close("linear", REFERENCE_OPS["linear"](th(x), th_quantized(qw), th(bias)), spec.linear(x, qw, bias))
    close("linear", th_ops.dequantize(th_quantized(qw)), spec.dequantize(qw))


# --- attention ---------------------------------------------------------------------------------


BATCHES = {
    "prefill": [(0, 7), (0, 3)],
    "chunked": [(5, 4), (12, 6)],
    "decode": [(6, 1), (1, 1), (17, 1)],
    "mixed": [(0, 5), (9, 1), (4, 3), (20, 1), (0, 1), (33, 2)],
    "long": [(0, 150), (37, 70), (100, 1)],
    "idle": [(3, 0), (5, 4), (7, 0), (9, 1), (2, 0)],  # some sequences without new tokens
}


def run_attention(rng, seqs, block_size, heads, head_dim, cache_dtype=np.float32):
    """torch attention and the spec on the same step; also returns both caches afterwards."""
    num_q, num_kv = heads
    meta, (key_cache, value_cache) = build_step(rng, seqs, block_size, num_kv, head_dim)
    key_cache, value_cache = key_cache.astype(cache_dtype), value_cache.astype(cache_dtype)
    n = int(meta.query_start_loc[-1])
    q, k, v = (randn(rng, n, h, head_dim) for h in (num_q, num_kv, num_kv))
    th_cache = (th(key_cache), th(value_cache))
    scale = head_dim**-0.5
    expected = spec.attention(q, k, v, (key_cache, value_cache), meta, scale)
    actual = REFERENCE_OPS["attention"](th(q), th(k), th(v), th_cache, meta, scale)
    return actual, expected, th_cache, (key_cache, value_cache)


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
    actual, expected, th_cache, np_cache = run_attention(rng, BATCHES[batch], block_size, heads, head_dim)
    close("attention", actual, expected)
    np.testing.assert_array_equal(host(th_cache[0]), np_cache[0])
    np.testing.assert_array_equal(host(th_cache[1]), np_cache[1])


def test_attention_float16_cache():
    rng = np.random.default_rng(4)
    actual, expected, th_cache, np_cache = run_attention(
        rng, BATCHES["mixed"], 16, (4, 2), 64, np.float16
    )
    assert actual.dtype == torch.float32  # the output has q's dtype, not the cache's
    close("attention", actual, expected)
    np.testing.assert_array_equal(host(th_cache[0]), np_cache[0])


def test_attention_reuses_step_metadata_across_layers():
    rng = np.random.default_rng(3)
    meta, _ = build_step(rng, BATCHES["mixed"], 4, 2, 32)
    n = int(meta.query_start_loc[-1])
    for layer in range(3):
        _, cache = build_step(np.random.default_rng(layer), BATCHES["mixed"], 4, 2, 32)
        q, k, v = randn(rng, n, 6, 32), randn(rng, n, 2, 32), randn(rng, n, 2, 32)
        actual = REFERENCE_OPS["attention"](th(q), th(k), th(v), (th(cache[0]), th(cache[1])), meta, 0.2)
        close("attention", actual, spec.attention(q, k, v, cache, meta, 0.2))
        assert len(meta.device) == 1  # built by the first layer, reused by the others


@pytest.mark.parametrize("context_lens", [[3, 9], []], ids=["idle", "no-sequences"])
def test_attention_on_a_step_without_new_tokens(context_lens):
    """Nothing to attend: an empty ``[0, Hq, D]`` result in q's dtype, the cache untouched."""
    rng = np.random.default_rng(15)
    blocks = max([-(-c // 4) for c in context_lens], default=1)
    meta = AttentionMetadata(
        query_start_loc=np.zeros(len(context_lens) + 1, dtype=np.int64),
        seq_lens=np.array(context_lens, dtype=np.int64),
        context_lens=np.array(context_lens, dtype=np.int64),
        block_tables=np.arange(len(context_lens) * blocks, dtype=np.int64).reshape(-1, blocks),
        slot_mapping=np.zeros(0, dtype=np.int64),
        block_size=4,
    )
    cache = (randn(rng, 16, 2, 8), randn(rng, 16, 2, 8))
    q, k, v = (np.zeros((0, h, 8), np.float32) for h in (4, 2, 2))
    th_cache = (th(cache[0]), th(cache[1]))
    expected = spec.attention(q, k, v, (cache[0].copy(), cache[1].copy()), meta, 0.5)
    for dtype in (torch.float32, torch.bfloat16):
        actual = REFERENCE_OPS["attention"](th(q).to(dtype), th(k), th(v), th_cache, meta, 0.5)
        assert tuple(actual.shape) == expected.shape == (0, 4, 8) and actual.dtype == dtype
    np.testing.assert_array_equal(host(th_cache[0]), cache[0])
    np.testing.assert_array_equal(host(th_cache[1]), cache[1])


# --- moe ---------------------------------------------------------------------------------------


def make_experts(rng, num_experts, hidden, inter):
    gate_up = [randn(rng, 2 * inter, hidden) * 0.3 for _ in range(num_experts)]
    down = [randn(rng, hidden, inter) * 0.3 for _ in range(num_experts)]
    return gate_up, down


@pytest.mark.parametrize(
    "n,experts,scoring,with_bias,renormalize",
    list(itertools.product([1, 6], [(4, 1), (8, 2), (8, 3)], ["softmax", "sigmoid"], [False, True], [False, True])),
)
def test_moe(n, experts, scoring, with_bias, renormalize):
    num_experts, top_k = experts
    rng = np.random.default_rng(n * 10 + num_experts + top_k)
    x, router = randn(rng, n, 32), randn(rng, num_experts, 32)
    gate_up, down = make_experts(rng, num_experts, 32, 24)
    bias = randn(rng, num_experts) if with_bias else None
    expected = spec.moe(x, router, gate_up, down, top_k, scoring, renormalize, bias)
    actual = REFERENCE_OPS["moe"](
        th(x), th(router), [th(w) for w in gate_up], [th(w) for w in down], top_k, scoring,
        renormalize, None if bias is None else th(bias),
    )
    close("moe", actual, expected)


def test_moe_quantized_experts():
    rng = np.random.default_rng(6)
    x, router = randn(rng, 5, 64), randn(rng, 4, 64)
    gate_up, down = make_experts(rng, 4, 64, 32)
    qgu = [quantize(w, "wint8", 32) for w in gate_up]
    qd = [quantize(w, "wint4", -1) for w in down]
    actual = REFERENCE_OPS["moe"](
        th(x), th(router), [th_quantized(w) for w in qgu], [th_quantized(w) for w in qd], 2
    )
    close("moe", actual, spec.moe(x, router, qgu, qd, 2))


def test_moe_router_ties_go_to_the_lower_expert():
    """Experts tied on score (+ correction bias) go to the lower expert id, as the spec says."""
    rng = np.random.default_rng(16)
    x, router = randn(rng, 3, 8), np.zeros((16, 8), np.float32)
    # A zero router scores every expert alike: the lowest ids win, best first.
    ids, weights = th_ops.route(th(x), th(router), 4)
    np.testing.assert_array_equal(host(ids), [[0, 1, 2, 3]] * 3)
    np.testing.assert_array_equal(host(ids), spec.route(x, router, 4)[0])
    close("moe", weights, np.full((3, 4), 0.25, np.float32))
    # Tied through the correction bias: 9 and 5 above the rest, then 12 above the others.
    bias = np.zeros(16, np.float32)
    bias[[9, 5, 12]] = [1.0, 1.0, 0.5]
    ids, _ = th_ops.route(th(x), th(router), 3, "sigmoid", True, th(bias))
    np.testing.assert_array_equal(host(ids), [[5, 9, 12]] * 3)
    np.testing.assert_array_equal(host(ids), spec.route(x, router, 3, "sigmoid", True, bias)[0])
    # And the op itself runs the experts the spec's router chose.
    gate_up, down = make_experts(rng, 16, 8, 6)
    for top_k, b in [(4, None), (3, bias)]:
        actual = REFERENCE_OPS["moe"](
            th(x), th(router), [th(w) for w in gate_up], [th(w) for w in down], top_k,
            "sigmoid", True, None if b is None else th(b),
        )
        close("moe", actual, spec.moe(x, router, gate_up, down, top_k, "sigmoid", True, b))


# --- sample ------------------------------------------------------------------------------------




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


def torch_sample(logits: np.ndarray, batch: SamplingBatch):
    return REFERENCE_OPS["sample"](th(logits), batch)


def assert_same_output(expected, actual) -> None:
    np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
    np.testing.assert_array_equal(actual.ranks, expected.ranks)
    np.testing.assert_array_equal(actual.top_ids, expected.top_ids)
    assert actual.token_ids.dtype == actual.ranks.dtype == actual.top_ids.dtype == np.int64
    close("sample", actual.logprobs, expected.logprobs)
    close("sample", actual.top_logprobs, expected.top_logprobs)


def check_sample(logits: np.ndarray, batch: SamplingBatch, paddle_runtime=None):
    """torch's sample equals the spec's, and the Paddle reference's token for token."""
    actual = torch_sample(logits, batch)
    assert_same_output(spec.sample(logits, batch), actual)
    if paddle_runtime is not None:
        import paddle

        theirs = paddle_runtime.REFERENCE_OPS["sample"](paddle.to_tensor(logits), batch)
        assert_same_output(theirs, actual)
    return actual


@pytest.mark.parametrize("num_rows,vocab", [(1, 10), (4, 1000), (3, 49152)])
def test_sample_greedy_is_argmax(num_rows, vocab):
    logits = randn(np.random.default_rng(vocab), num_rows, vocab) * 3
    out = check_sample(logits, make_sampling_batch(num_rows, temperature=[0.0] * num_rows))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
    np.testing.assert_array_equal(out.ranks, np.ones(num_rows))
    assert out.top_ids.shape == out.top_logprobs.shape == (num_rows, 0)


@pytest.mark.parametrize("seed", range(12))
def test_sample_matches_spec_and_paddle_on_mixed_batches(seed, paddle_runtime):
    rng = np.random.default_rng(seed)
    num_rows, vocab = int(rng.integers(1, 12)), int(rng.choice([50, 700, 5000]))
    logits = randn(rng, num_rows, vocab) * 2
    check_sample(logits, random_batch(rng, num_rows, vocab), paddle_runtime)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 5, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (0.7, 0, 1.0, 0.2), (1.3, 20, 0.8, 0.05), (1.0, 1, 1.0, 0.0)],
)
def test_sample_filters_match_spec_and_paddle(temperature, top_k, top_p, min_p, paddle_runtime):
    rng = np.random.default_rng(10)
    vocab, num_rows = 60, 300
    logits = np.repeat(randn(rng, 1, vocab) * 1.5, num_rows, axis=0)
    batch = make_sampling_batch(
        num_rows, temperature=[temperature] * num_rows, top_k=[top_k] * num_rows,
        top_p=[top_p] * num_rows, min_p=[min_p] * num_rows,
    )
    check_sample(logits, batch, paddle_runtime)


@pytest.mark.parametrize(
    "spread,top_p,top_k,width",
    [(6.0, 0.9, 0, 256), (1.5, 0.9, 0, 2048), (0.05, 0.95, 0, 4096), (6.0, 0.9, 100, 100)],
)
def test_top_p_over_a_large_vocabulary(spread, top_p, top_k, width, monkeypatch, paddle_runtime):
    """The nucleus is found from the top-k survivors, a top-k head widened as needed, or a full
    sort; all give the spec's draw."""
    rng = np.random.default_rng(13)
    vocab, num_rows = 4096, 6
    logits = randn(rng, num_rows, vocab) * spread
    batch = make_sampling_batch(
        num_rows, top_p=[top_p] * num_rows, top_k=[top_k] * num_rows,
        seeds=rng.integers(0, 1000, num_rows),
    )
    widths = []
    head = th_ops._nucleus_head
    monkeypatch.setattr(th_ops, "_nucleus_head", lambda *a: widths.append(head(*a).shape[1]) or head(*a))
    check_sample(logits, batch, paddle_runtime)
    assert widths == [width]


def test_sample_draws_follow_the_distribution():
    """The exponential race picks each token with its probability (4000 seeded rows)."""
    probs = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
    num_rows = 4000
    logits = np.repeat(np.log(np.maximum(probs, 1e-30))[None].astype(np.float32), num_rows, 0)
    out = check_sample(logits, make_sampling_batch(num_rows))
    freq = np.bincount(out.token_ids, minlength=5) / num_rows
    np.testing.assert_allclose(freq, probs, atol=0.03)
    assert freq[4] == 0


def test_sampling_noise_is_the_specs_computed_on_the_device():
    """The torch reference computes the contract's counter-based noise on a GPU with int64
    tensor ops (on the CPU with the spec's NumPy): the integer hash bit for bit (so v exactly),
    then float32 log1p within an ulp or two. Large seeds (high word set, near 2**63) and steps
    past 2**32 included."""
    seeds = np.array([0, 1, 2**32 + 3, 2**63 - 1, 123456789], dtype=np.int64)
    steps = np.array([0, 5, 7, 2**33 + 1, 2**31], dtype=np.int64)
    batch = make_sampling_batch(5, seeds=seeds, steps=steps)
    rows = np.array([4, 0, 2, 3, 1])
    expected = spec.sampling_noise(seeds[rows], steps[rows], 70000)
    # On the CPU the reference takes NumPy's path; the tensor path is the one a GPU runs.
    cpu = torch.device("cpu")
    np.testing.assert_array_equal(th_ops.sampling_noise(batch, rows, 70000, cpu).numpy(), expected)
    keys = torch.from_numpy(host_plan.noise_keys(batch, rows))
    actual = th_ops._tensor_noise(keys, 70000).numpy()
    assert actual.dtype == np.float32
    np.testing.assert_array_max_ulp(actual, expected, maxulp=2)
    # The integer mix itself is exact, over the whole uint32 range (products overflow int64 if
    # not split).
    x = np.random.default_rng(0).integers(0, 2**32, 100000, dtype=np.uint32)
    x[:3] = [0, 1, 2**32 - 1]
    mixed = th_ops._lowbias32(torch.from_numpy(x.astype(np.int64))).numpy()
    np.testing.assert_array_equal(mixed, spec._lowbias32(x).astype(np.int64))


def test_seeded_rows_are_independent_of_the_batch():
    rng = np.random.default_rng(9)
    vocab = 400
    row = randn(rng, 1, vocab)
    alone = make_sampling_batch(1, temperature=[1.0], top_k=[50], top_p=[0.9], min_p=[0.01], seeds=[1234], steps=[7])
    token = torch_sample(row, alone).token_ids[0]
    others = random_batch(rng, 5, vocab)
    for position in (0, 2, 5):
        logits = np.insert(randn(rng, 5, vocab), position, row[0], axis=0)
        fields = {
            name: (np.insert(value, position, getattr(alone, name)[0]) if isinstance(value, np.ndarray)
                   else value[:position] + [getattr(alone, name)[0]] + value[position:]
                   if isinstance(value, list) else value)
            for name, value in vars(others).items()
        }
        assert torch_sample(logits, SamplingBatch(**fields)).token_ids[position] == token


def test_sample_ties_rank_and_top_ids_like_the_spec(paddle_runtime):
    # Ties inside the top-k, at its edge, and a greedy argmax over tied maxima; top_ids ties go
    # to the lower id, on the Paddle reference too.
    logits = np.array(
        [[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 1.0]], dtype=np.float32
    )
    for temperature in (0.0, 1.0):
        batch = make_sampling_batch(3, temperature=[temperature] * 3, num_logprobs=2)
        out = check_sample(logits, batch, paddle_runtime)
        np.testing.assert_array_equal(out.top_ids, [[1, 2], [0, 1], [1, 2]])
    out = check_sample(logits, make_sampling_batch(3, temperature=[0.0] * 3, num_logprobs=2))
    np.testing.assert_array_equal(out.token_ids, [1, 0, 1])
    np.testing.assert_array_equal(out.ranks, [2, 4, 1])
    # Over a large vocabulary: a flat row, and one whose runner-up ties with every other token.
    flat = np.zeros((2, 5000), np.float32)
    flat[1, 4999] = 1.0
    out = check_sample(flat, make_sampling_batch(2, temperature=[0.0, 0.0], num_logprobs=3), paddle_runtime)
    np.testing.assert_array_equal(out.top_ids, [[0, 1, 2], [4999, 0, 1]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_token_logprobs_match_spec_and_paddle(dtype, paddle_runtime):
    """Tied rows included; in bfloat16 the spec runs on the rounded logits, as the kit does."""
    rng = np.random.default_rng(21)
    logits = randn(rng, 7, 900) * 3
    logits[1::2] = np.round(logits[1::2])
    tensor = th(logits).to(getattr(torch, dtype))
    ids = rng.integers(0, 900, 7).astype(np.int64)
    for k in (0, 4):
        actual = REFERENCE_OPS["token_logprobs"](tensor, th(ids), k)
        assert_same_output(spec.token_logprobs(host(tensor), ids, k), actual)
        if dtype == "float32":
            import paddle

            theirs = paddle_runtime.REFERENCE_OPS["token_logprobs"](paddle.to_tensor(logits), paddle.to_tensor(ids), k)
            assert_same_output(theirs, actual)


def test_penalties_match_spec():
    for seed in range(3):
        rng = np.random.default_rng(seed + 20)
        batch = random_batch(rng, 6, 200)
        logits = randn(rng, 6, 200) * 3
        close("sample", th_ops.apply_penalties(th(logits), batch), spec.apply_penalties(logits, batch))


def test_penalties_and_suppression_steer_greedy_choice(paddle_runtime):
    logits = np.array([[0.1, 2.0, 1.9, 1.0]] * 3, np.float32)
    batch = make_sampling_batch(
        3, temperature=[0.0] * 3, frequency_penalty=[0.0, 0.3, 0.0],
        output_token_ids=[[1], [1], []], suppress_token_ids=[[], [], [1, 2]],
    )
    out = check_sample(logits, batch, paddle_runtime)
    np.testing.assert_array_equal(out.token_ids, [1, 2, 3])
    np.testing.assert_array_equal(out.ranks, [1, 2, 3])  # ranks are on the raw logits


def test_sample_leaves_the_logits_untouched():
    """Suppression must not write -inf into the caller's (float32, so uncast) logits."""
    logits = randn(np.random.default_rng(11), 2, 30)
    tensor = th(logits)
    for temperature in (0.0, 1.0):
        batch = make_sampling_batch(2, temperature=[temperature] * 2, suppress_token_ids=[[0, 1], [2]])
        torch_sample(logits, batch)
        REFERENCE_OPS["sample"](tensor, batch)
        np.testing.assert_array_equal(host(tensor), logits)


def test_tiny_temperature_is_greedy_without_overflow():
    logits = randn(np.random.default_rng(12), 3, 500) * 50
    out = check_sample(logits, make_sampling_batch(3, temperature=[1e-6] * 3))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))


def test_sample_accepts_half_precision_logits():
    logits = randn(np.random.default_rng(14), 4, 300) * 2
    as_bf16 = host(th(logits).bfloat16())  # the values the bfloat16 tensor holds
    batch = make_sampling_batch(4, temperature=[0.0, 0.7, 1.0, 0.0], top_p=[1.0, 0.9, 1.0, 1.0], num_logprobs=3)
    assert_same_output(spec.sample(as_bf16, batch), REFERENCE_OPS["sample"](th(logits).bfloat16(), batch))


def test_sample_rejects_token_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        torch_sample(np.zeros((1, 5), np.float32), make_sampling_batch(1, suppress_token_ids=[[5]]))


# --- TorchMemory -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def memory() -> TorchMemory:
    return TorchMemory("cpu")


def test_implements_the_memory_protocol(memory):
    assert isinstance(memory, Memory)
    assert memory.device == "cpu"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.int8, np.float16, np.bool_])
def test_round_trip_keeps_values_and_dtype(memory, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    tensor = memory.from_numpy(array)
    assert isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"
    back = memory.to_numpy(tensor)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, array)


def test_from_numpy_and_to_numpy_copy(memory):
    array = np.ones(4, np.float32)
    tensor = memory.from_numpy(array)
    array[0] = 5
    assert memory.to_numpy(tensor)[0] == 1
    back = memory.to_numpy(tensor)
    tensor[1] = 7  # a later in-place write (attention's cache update) must not show in `back`
    assert back[1] == 1


def test_from_numpy_handles_non_contiguous_arrays(memory):
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    np.testing.assert_array_equal(memory.to_numpy(memory.from_numpy(array)), array)


@pytest.mark.parametrize("dtype,rtol", [("bfloat16", 2**-8), ("float16", 2**-11), ("float32", 0)])
def test_from_numpy_casts_and_bfloat16_returns_as_float32(memory, dtype, rtol):
    array = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    tensor = memory.from_numpy(array, dtype)
    assert tensor.dtype == getattr(torch, dtype)
    back = memory.to_numpy(tensor)
    assert back.dtype == (np.float16 if dtype == "float16" else np.float32)
    np.testing.assert_allclose(back.astype(np.float32), array, rtol=rtol, atol=0)
    if dtype != "float32":
        assert not np.array_equal(back, array)  # the cast really happened


def test_from_numpy_casts_integers_and_rejects_unknown_dtypes(memory):
    assert memory.from_numpy(np.array([1, 2, 3], np.int32), "int64").dtype == torch.int64
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.from_numpy(np.zeros(2, np.float32), "float7")
    with pytest.raises(ValueError, match="unknown dtype"):
        memory.from_numpy(np.zeros(2, np.float32), "Tensor")  # a torch attribute, not a dtype


@pytest.mark.parametrize("host_cache", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kv_cache_layout(memory, dtype, host_cache):
    allocate = memory.allocate_host_kv_cache if host_cache else memory.allocate_kv_cache
    caches = allocate(3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    assert len(caches) == 3
    tensors = [t for pair in caches for t in pair]
    for t in tensors:
        assert tuple(t.shape) == (20, 2, 8)
        assert t.dtype == getattr(torch, dtype) and t.device.type == "cpu"
        assert not t.is_pinned()  # pinning is for a CUDA device's swap space only
        assert not memory.to_numpy(t).any()
    tensors[0][3] = 1  # every key and value is its own allocation
    assert memory.to_numpy(tensors[0]).sum() == 16
    assert all(memory.to_numpy(t).sum() == 0 for t in tensors[1:])


def random_caches(memory, rng, dtype, num_blocks, bs=4, layers=2):
    host = [
        tuple(rng.standard_normal((num_blocks * bs, 2, 3)).astype(np.float32) for _ in range(2))
        for _ in range(layers)
    ]
    return [tuple(memory.from_numpy(a, dtype) for a in pair) for pair in host]


def as_blocks(memory, tensor, bs=4) -> np.ndarray:
    array = memory.to_numpy(tensor)
    return array.reshape(-1, bs, *array.shape[1:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_copy_blocks_copies_whole_blocks_in_every_layer_in_place(memory, dtype):
    caches = random_caches(memory, np.random.default_rng(1), dtype, num_blocks=6)
    before = [[as_blocks(memory, t) for t in pair] for pair in caches]
    originals = [list(pair) for pair in caches]
    # Block 1 is both copied from and overwritten: it is read before anything is written.
    pairs = [(1, 4), (0, 1), (2, 5)]
    memory.copy_blocks(caches, 4, pairs)
    for layer, pair in enumerate(caches):
        for which, tensor in enumerate(pair):
            assert tensor is originals[layer][which]
            expected = before[layer][which].copy()
            for src, dst in pairs:
                expected[dst] = before[layer][which][src]
            np.testing.assert_array_equal(as_blocks(memory, tensor), expected)


def test_copy_and_swap_with_nothing_to_copy(memory):
    caches = memory.allocate_kv_cache(1, 2, 4, 1, 2, "float32")
    host = memory.allocate_host_kv_cache(1, 2, 4, 1, 2, "float32")
    memory.copy_blocks(caches, 4, [])
    memory.swap_blocks(caches, host, 4, [])
    assert not memory.to_numpy(caches[0][0]).any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_swap_blocks_round_trip_through_host_memory(memory, dtype):
    rng = np.random.default_rng(2)
    device = random_caches(memory, rng, dtype, num_blocks=8)
    original = [[as_blocks(memory, t) for t in pair] for pair in device]
    host = memory.allocate_host_kv_cache(2, 5, 4, 2, 3, dtype)
    # Out: runs of consecutive blocks and single ones, into scattered host blocks.
    out = [(2, 0), (3, 1), (4, 2), (6, 4), (0, 3)]
    memory.swap_blocks(device, host, 4, out)
    for layer in range(2):
        for which in range(2):
            got = as_blocks(memory, host[layer][which])
            for src, dst in out:
                np.testing.assert_array_equal(got[dst], original[layer][which][src])
    # Clobber the device cache, then swap back in to other device blocks.
    for pair in device:
        for t in pair:
            t.zero_()
    back = [(0, 5), (1, 6), (2, 7), (4, 1), (3, 0)]
    memory.swap_blocks(host, device, 4, back)
    for layer in range(2):
        for which in range(2):
            got = as_blocks(memory, device[layer][which])
            for (src, mid), (_, dst) in zip(sorted(out, key=lambda p: p[1]), sorted(back)):
                np.testing.assert_array_equal(got[dst], original[layer][which][src])
            untouched = sorted(set(range(8)) - {dst for _, dst in back})
            assert not got[untouched].any()


def test_block_runs_coalesce_consecutive_blocks():
    runs = th_memory._block_runs
    assert runs([(2, 0), (3, 1), (4, 2), (6, 4), (0, 3)]) == [(0, 3, 1), (2, 0, 3), (6, 4, 1)]
    assert runs([(5, 9), (4, 8)]) == [(4, 8, 2)]
    assert runs([(1, 1), (2, 3)]) == [(1, 1, 1), (2, 3, 1)]  # the destinations are not adjacent


def test_memory_info_reports_host_ram(memory):
    free, total = memory.memory_info()
    assert 0 < free <= total
    with open("/proc/meminfo") as f:
        mem_total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert total == mem_total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_writes_into_an_allocated_cache(memory, dtype):
    """The cache from allocate_kv_cache is what attention reads and writes, slot for slot."""
    rng = np.random.default_rng(2)
    meta = AttentionMetadata(
        query_start_loc=np.array([0, 3, 4]),
        seq_lens=np.array([3, 6]),
        context_lens=np.array([0, 5]),
        block_tables=np.array([[2, 0], [3, 1]]),
        slot_mapping=np.array([8, 9, 10, 5]),  # seq 1, position 5: block 1, offset 1
        block_size=4,
    )
    ((key, value),) = memory.allocate_kv_cache(1, 4, 4, 2, 8, dtype)
    q, k, v = (rng.standard_normal((4, h, 8)).astype(np.float32) for h in (4, 2, 2))
    host_cache = (memory.to_numpy(key), memory.to_numpy(value))
    out = REFERENCE_OPS["attention"](
        memory.from_numpy(q), memory.from_numpy(k), memory.from_numpy(v), (key, value), meta, 0.3
    )
    expected = spec.attention(q, k, v, host_cache, meta, 0.3)
    tol = 1e-2 if dtype == "bfloat16" else 0
    np.testing.assert_allclose(memory.to_numpy(key), host_cache[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(memory.to_numpy(value)[[8, 9, 10, 5]], v, rtol=tol, atol=tol)
    assert not memory.to_numpy(key)[[0, 1, 2, 3, 4, 6, 7, 11]].any()
    np.testing.assert_allclose(memory.to_numpy(out), expected, rtol=1e-4 + tol, atol=1e-5 + tol)


# --- end to end: a tiny Llama on both runtimes -----------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")  # the checkpoint is written with transformers
    from tests import checkpoints

    return checkpoints.make_llama(tmp_path_factory.mktemp("torch_runtime"))


E2E_BLOCK, E2E_BLOCKS, E2E_MAX_LEN = 4, 64, 128


def load_model(model_dir, runtime: str, reference_ops: dict, memory):
    """A model on ``runtime``'s reference ops, the op table chosen as the engine chooses one."""
    from fd_core.loader import load_checkpoint
    from fd_core.models import build_model
    from fd_core.plugins.ops import OpRegistry

    registry = OpRegistry()
    registry.register_reference(runtime, reference_ops)
    ops = registry.select("e2e-test", runtime)
    assert not ops.missing()
    checkpoint = load_checkpoint(model_dir)
    model = build_model(checkpoint.config, ops, memory, E2E_MAX_LEN)
    model.load_weights(checkpoint.weights())
    return model, ops


def generate(model, ops, memory, prompts, steps, batch_for):
    """Prefill every prompt in one step, then ``steps`` decode steps; returns the logits of every
    prompt position, then of each decode step, and the tokens sampled."""
    c = model.config
    caches = memory.allocate_kv_cache(
        c.num_hidden_layers, E2E_BLOCKS, E2E_BLOCK, c.num_key_value_heads, c.head_dim, "float32"
    )
    # Shuffled block tables, so the paging is exercised; each sequence gets room for all steps.
    per_seq = -(-(max(map(len, prompts)) + steps) // E2E_BLOCK)
    blocks = np.random.default_rng(0).permutation(E2E_BLOCKS)
    tables = blocks[: len(prompts) * per_seq].reshape(len(prompts), per_seq).astype(np.int64)
    tokens = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    logits_seen, sampled = [], []
    for step in range(steps + 1):
        new = [t[done:] for t, done in zip(tokens, computed)]
        positions = np.concatenate([np.arange(d, d + len(n)) for d, n in zip(computed, new)])
        seq_of_token = np.repeat(np.arange(len(prompts)), [len(n) for n in new])
        qsl = np.concatenate([[0], np.cumsum([len(n) for n in new])]).astype(np.int64)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=np.array([len(t) for t in tokens], np.int64),
            context_lens=np.array(computed, np.int64),
            block_tables=tables,
            slot_mapping=(tables[seq_of_token, positions // E2E_BLOCK] * E2E_BLOCK
                          + positions % E2E_BLOCK).astype(np.int64),
            block_size=E2E_BLOCK,
        )
        ids = np.concatenate(new).astype(np.int64)
        hidden = model.forward(memory.from_numpy(ids), memory.from_numpy(positions), caches, meta)
        # Prefill: the logits of every position; decode: of the one new row of each sequence.
        last_rows = memory.from_numpy(qsl[1:] - 1)
        rows = memory.from_numpy(np.arange(len(ids))) if step == 0 else last_rows
        logits = model.compute_logits(hidden, rows)
        logits_seen.append(memory.to_numpy(logits))
        if step == 0:
            logits = ops.embedding(logits, last_rows)  # the rows that sample (a row gather)
        out = ops.sample(logits, batch_for(step, tokens, prompts))
        sampled.append(out.token_ids.tolist())
        computed = [len(t) for t in tokens]
        for t, token in zip(tokens, out.token_ids):
            t.append(int(token))
    return logits_seen, sampled


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


PROMPTS = [[1, 17, 300, 42, 9, 8, 101, 7, 5, 88, 64], [1, 2, 3, 4, 5], list(range(30, 47))]


def greedy_batch(step, tokens, prompts):
    return make_sampling_batch(len(tokens), temperature=[0.0] * len(tokens))


def seeded_batch(step, tokens, prompts):
    # Temperature 0.5: a random-weight model's logits are small, and at 1 the draw would hardly
    # depend on them. Penalties over the prompt and output, so those paths run too.
    n = len(tokens)
    return make_sampling_batch(
        n, temperature=[0.5] * n, top_p=[0.9] * n, top_k=[0, 40, 0], min_p=[0.0, 0.0, 0.05],
        repetition_penalty=[1.1] * n, frequency_penalty=[0.2] * n, seeds=[11, 12, 13], steps=[step] * n,
        prompt_token_ids=[np.array(p) for p in prompts],
        output_token_ids=[np.array(t[len(p):]) for t, p in zip(tokens, prompts)], num_logprobs=2,
    )


@pytest.mark.parametrize("batch_for", [greedy_batch, seeded_batch], ids=["greedy", "seeded"])
def test_tiny_llama_matches_the_paddle_runtime(llama_dir, paddle_runtime, batch_for):
    steps = 16
    runs = {}
    for name, module, memory in [
        ("torch", th_ops, TorchMemory("cpu")),
        ("paddle", paddle_runtime, paddle_runtime.PaddleMemory("cpu")),
    ]:
        model, ops = load_model(llama_dir, name, module.REFERENCE_OPS, memory)
        runs[name] = generate(model, ops, memory, PROMPTS, steps, batch_for)
    (th_logits, th_tokens), (pd_logits, pd_tokens) = runs["torch"], runs["paddle"]
    assert th_logits[0].shape == (sum(map(len, PROMPTS)), 512)
    for ours, theirs in zip(th_logits, pd_logits):
        assert relative_error(ours, theirs) <= 1e-4
    assert th_tokens == pd_tokens
    assert len(th_tokens) == steps + 1
    if batch_for is greedy_batch:  # the greedy tokens follow from the logits compared above
        ends = np.cumsum([len(p) for p in PROMPTS]) - 1
        assert th_tokens[0] == th_logits[0][ends].argmax(axis=1).tolist()
        assert th_tokens[1:] == [row.argmax(axis=1).tolist() for row in th_logits[1:]]


def test_engine_on_the_torch_runtime_matches_paddle_through_swap_preemption(llama_dir):
    """The whole engine on a platform whose runtime is "torch" (ops found through the registry's
    runtime table, TorchMemory for the caches and the swap space): seeded outputs equal the
    Paddle CPU backend's, with a KV cache small enough that sequences are swapped out and in."""
    from fd_core import SamplingParams
    from fd_core.backends.cpu import CpuPlatform
    from fd_core.engine.config import EngineConfig
    from fd_core.engine.engine import LLMEngine
    from fd_core.plugins.registry import BackendRegistry

    class TorchCpuPlatform(CpuPlatform):
        name = device_type = "torch-cpu"
        runtime = "torch"

        def memory(self, device_index: int = 0):
            return TorchMemory("cpu")

    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 400, size=int(rng.integers(9, 30))).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0.5, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)

    def run(platform, **engine_args):
        config = EngineConfig(model=str(llama_dir), max_model_len=E2E_MAX_LEN, block_size=4, **engine_args)
        engine = LLMEngine(config, platform, BackendRegistry(entry_points=[]))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outputs = engine.run()
        return [outputs[str(i)].outputs[0].token_ids for i in range(len(prompts))], engine

    reference, _ = run(CpuPlatform(), num_kv_blocks=512)
    roomy, engine = run(TorchCpuPlatform(), num_kv_blocks=512)
    assert isinstance(engine.memory, TorchMemory) and engine.core.ops.runtime == "torch"
    assert roomy == reference
    tight, engine = run(TorchCpuPlatform(), num_kv_blocks=4 * 12 + 1, swap_space=0.05)
    assert engine.scheduler.num_swapped_out > 0 and engine.scheduler.num_recomputed == 0
    assert tight == reference


@pytest.mark.parametrize("offset, count", [(0, 8), (2, 3)])
def test_moe_dense_form_equals_the_grouped_one(offset, count):
    """The form a captured graph runs (every local expert on every row, no host read) gives the
    grouped form's output, with all experts or a rank's share."""
    from fd_core.runtimes.torch import ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=g)
    router = torch.randn(8, 16, generator=g)
    gate_up = [torch.randn(24, 16, generator=g) * 0.3 for _ in range(8)][offset : offset + count]
    down = [torch.randn(16, 12, generator=g) * 0.3 for _ in range(8)][offset : offset + count]
    bias = torch.randn(8, generator=g) * 0.1
    want = ops.moe(x, router, gate_up, down, 2, "softmax", True, bias, expert_offset=offset)
    ids, weights = ops.route(x, router, 2, "softmax", True, bias)
    got = ops._moe_dense(x, ids, weights, gate_up, down, offset)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
