"""The CUDA backend's sampler (``fd_backend_cuda.kernels.sampling``) against the executable
specification, ``fd_core.testing.spec.sample``.

Without a CUDA device the kernel runs on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before Triton is imported), so the grid is kept small; the
larger vocabularies and batches (``gpu`` marker) run only on a device. Token ids, ranks and top
ids must equal the spec's; logprobs are held to ``spec.TOLERANCES["sample"]``. The contract lets
two implementations differ on near-exact ties (see ``OP_SPECS["sample"]``); the cases here have
none, so any difference is a bug.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl

from fd_core.interfaces.ops import SamplingBatch
from fd_core.testing import spec
from fd_core.testing.batches import make_sampling_batch

from fd_backend_cuda import ops
from fd_backend_cuda.kernels import sampling
from fd_backend_cuda.kernels._common import interpreting

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")




# Row settings: (temperature, top_k, top_p, min_p).
MODES = {
    "greedy": (0.0, 0, 1.0, 0.0),
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k": (1.0, 40, 1.0, 0.0),
    "top_p": (1.0, 0, 0.9, 0.0),
    "min_p": (1.2, 0, 1.0, 0.05),
    "top_k_top_p": (0.7, 50, 0.95, 0.0),
    "all": (1.0, 100, 0.8, 0.02),
}


def mixed_batch(rng: np.random.Generator, rows: int, vocab: int, modes: list[str], **extra):
    chosen = [MODES[modes[i % len(modes)]] for i in range(rows)]
    return make_sampling_batch(
        rows,
        temperature=[m[0] for m in chosen],
        top_k=[m[1] for m in chosen],
        top_p=[m[2] for m in chosen],
        min_p=[m[3] for m in chosen],
        seeds=rng.integers(0, 2**63 - 1, rows),
        steps=rng.integers(0, 10_000, rows),
        **extra,
    )


def logits_like_a_model(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """A heavy head over a long tail, as a language model's logits look."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    head = rng.integers(0, vocab, (rows, 20))
    np.put_along_axis(x, head, rng.uniform(6, 12, (rows, 20)).astype(np.float32), axis=1)
    return x


def check(logits: np.ndarray, batch: SamplingBatch):
    expected = spec.sample(logits, batch)
    actual = ops.sample(torch.from_numpy(logits).to(DEVICE), batch)
    np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
    np.testing.assert_array_equal(actual.ranks, expected.ranks)
    np.testing.assert_array_equal(actual.top_ids, expected.top_ids)
    np.testing.assert_allclose(actual.logprobs, expected.logprobs, **spec.TOLERANCES["sample"])
    np.testing.assert_allclose(
        actual.top_logprobs, expected.top_logprobs, **spec.TOLERANCES["sample"]
    )
    for name in ("token_ids", "ranks", "top_ids"):
        assert getattr(actual, name).dtype == np.int64
    assert actual.logprobs.dtype == actual.top_logprobs.dtype == np.float32
    return actual


# --- the noise ---------------------------------------------------------------------------------


@triton.jit
def _noise_kernel(keys_ptr, out_ptr, vocab, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0)
    key0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    key1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    for start in range(0, vocab, BLOCK):
        c = start + tl.arange(0, BLOCK)
        tl.store(out_ptr + row * vocab + c, sampling._noise(c, key0, key1, PRECISE), c < vocab)


def test_kernel_noise_is_the_contracts():
    """The in-kernel noise equals ``spec.sampling_noise`` within a few ulps of log1p, for seeds
    with the high word set and steps past 2**32."""
    seeds = np.array([0, 7, 2**40 + 1, 2**63 - 1], np.int64)
    steps = np.array([0, 1, 2**32 + 5, 99], np.int64)
    vocab = 50000
    key0, key1 = spec.sampling_keys(seeds, steps)
    keys = torch.from_numpy(np.stack([key0, key1], 1).astype(np.int64)).to(DEVICE)
    out = torch.empty(len(seeds), vocab, device=DEVICE)
    _noise_kernel[(len(seeds),)](keys, out, vocab, BLOCK=8192, PRECISE=not interpreting())
    np.testing.assert_array_max_ulp(
        out.cpu().numpy(), spec.sampling_noise(seeds, steps, vocab), maxulp=4
    )


# --- against the spec --------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1000, 32007])
@pytest.mark.parametrize("modes", [["greedy"], ["temperature", "top_p"], list(MODES)])
def test_sample_matches_spec(vocab, modes):
    rng = np.random.default_rng(vocab + len(modes))
    rows = len(modes) if len(modes) > 1 else 3
    logits = logits_like_a_model(rng, rows, vocab)
    check(logits, mixed_batch(rng, rows, vocab, modes, num_logprobs=int(vocab < 2000) * 3))


@pytest.mark.parametrize("cap", [16, 256])
@pytest.mark.parametrize("vocab", [5003, 32007])
def test_searches_that_gather_their_candidates_match_spec(cap, vocab):
    """With a small scratch row, top-k and top-p searches gather their last candidates after a
    pass or two (or never, where more than ``cap`` remain) and finish on them."""
    rng = np.random.default_rng(cap + vocab)
    modes = ["top_k", "top_p", "top_k_top_p", "all", "min_p", "greedy"]
    logits = logits_like_a_model(rng, len(modes), vocab)
    logits[1] = rng.standard_normal(vocab) * 3  # a wide nucleus
    batch = mixed_batch(rng, len(modes), vocab, modes, num_logprobs=2)
    expected = spec.sample(logits, batch)
    actual = sampling.sample(torch.from_numpy(logits).to(DEVICE), batch, cap=cap)
    np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
    np.testing.assert_array_equal(actual.top_ids, expected.top_ids)


@pytest.mark.parametrize("seed", range(4))
def test_sample_matches_spec_with_penalties_suppression_and_logprobs(seed):
    rng = np.random.default_rng(seed)
    rows, vocab = 5, int(rng.choice([300, 2048, 5003]))

    def tokens(most: int) -> list[np.ndarray]:
        return [rng.integers(0, vocab, rng.integers(0, most)) for _ in range(rows)]

    batch = mixed_batch(
        rng,
        rows,
        vocab,
        list(rng.permutation(list(MODES)))[:rows],
        presence_penalty=rng.choice([0.0, 0.5, -0.3], rows),
        frequency_penalty=rng.choice([0.0, 0.2], rows),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8], rows),
        prompt_token_ids=tokens(12),
        output_token_ids=tokens(20),
        suppress_token_ids=tokens(6),
        num_logprobs=int(rng.choice([0, 1, 5])),
    )
    check(logits_like_a_model(rng, rows, vocab), batch)


@pytest.mark.parametrize("seed", range(3))
def test_sample_matches_spec_with_logit_bias(seed):
    """OpenAI's logit_bias (API 1.11), added before the penalties: a greedy row flipped to its
    fourth best token, one whose argmax is banned with -100, a filtered and penalised row biased
    either way, +100 on a suppressed token and on one the grammar's bitmask leaves out (neither
    drawn), and rows without a bias beside them; the caller's logits stay as they were."""
    from fd_core.interfaces.ops import pack_token_bitmask

    rng = np.random.default_rng(100 + seed)
    rows, vocab = 6, int(rng.choice([300, 2048, 5003]))
    logits = logits_like_a_model(rng, rows, vocab)
    order = np.argsort(-logits, axis=1, kind="stable")
    fourth = order[1, 3]
    bias = [
        ([], []),
        ([fourth], [logits[1, order[1, 0]] - logits[1, fourth] + 0.5]),
        ([order[2, 0]], [-100.0]),
        (rng.choice(vocab, 40, replace=False), rng.uniform(-6, 6, 40)),
        ([order[4, 0], order[4, 1]], [100.0, 100.0]),
        ([], []),
    ]
    allowed = np.ones((rows, vocab), dtype=bool)
    allowed[4, order[4, 1]] = False
    batch = mixed_batch(
        rng,
        rows,
        vocab,
        ["greedy", "greedy", "greedy", "top_k_top_p", "temperature", "min_p"],
        repetition_penalty=[1.0, 1.0, 1.0, 1.3, 1.0, 1.2],
        presence_penalty=[0.0, 0.0, 0.0, 0.5, 0.0, 0.0],
        output_token_ids=[[], [], [], list(rng.integers(0, vocab, 10)), [], list(order[5, :4])],
        suppress_token_ids=[[], [], [], [], [order[4, 0]], []],
        logit_bias=bias,
        num_logprobs=2,
    )
    batch.allowed_token_bitmask = pack_token_bitmask(allowed)
    actual = check(logits, batch)
    assert actual.token_ids[1] == fourth and actual.token_ids[2] == order[2, 1]
    assert actual.token_ids[4] not in order[4, :2]
    device_logits = torch.from_numpy(logits).to(DEVICE)
    before = device_logits.clone()
    pending = ops.sample_async(device_logits, batch)
    np.testing.assert_array_equal(pending.result().token_ids, actual.token_ids)
    assert torch.equal(device_logits, before)


@pytest.mark.parametrize("cap", [16, 256])
@pytest.mark.parametrize("seed", range(3))
def test_the_grammar_bitmask_read_in_the_kernel_matches_spec(seed, cap):
    """The bitmask alone (the kernel reads the raw logits and the mask: nothing else processed)
    and with penalties, in every mode, with rows that allow one token, a few (greedy's argmax
    and top-k's survivors among the left out), most, or all; small ``cap`` makes the searches
    gather, so the scratch row must hold allowed tokens only. Logprobs stay the raw ones."""
    from fd_core.interfaces.ops import pack_token_bitmask

    rng = np.random.default_rng(200 + seed)
    modes = list(MODES)
    rows, vocab = len(modes), int(rng.choice([300, 2048, 5003]))
    logits = logits_like_a_model(rng, rows, vocab)
    order = np.argsort(-logits, axis=1, kind="stable")
    allowed = rng.random((rows, vocab)) < rng.choice([0.02, 0.3, 0.9], (rows, 1))
    allowed[0, :] = False
    allowed[0, order[0, 7]] = True  # greedy: one token allowed, not the argmax
    allowed[2, order[2, :60]] = False  # top-k: its survivors all left out
    allowed[3] = True  # a row the grammar does not constrain
    logits[1, ~allowed[1]] += 200.0  # left out, and far above the allowed: exp() of the gap overflows
    for penalties in (False, True):
        extra = {"repetition_penalty": rng.choice([1.0, 1.3], rows),
                 "output_token_ids": [rng.integers(0, vocab, 8) for _ in range(rows)]} if penalties else {}
        batch = mixed_batch(rng, rows, vocab, modes, num_logprobs=3, **extra)
        batch.allowed_token_bitmask = pack_token_bitmask(allowed)
        expected = spec.sample(logits, batch)
        actual = sampling.sample(torch.from_numpy(logits).to(DEVICE), batch, cap=cap)
        np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
        np.testing.assert_array_equal(actual.ranks, expected.ranks)
        np.testing.assert_array_equal(actual.top_ids, expected.top_ids)
        np.testing.assert_allclose(actual.logprobs, expected.logprobs, **spec.TOLERANCES["sample"])
        assert all(allowed[r, t] for r, t in enumerate(actual.token_ids))
        assert actual.token_ids[0] == order[0, 7]


def test_sample_draws_follow_the_distribution():
    """Over many seeds the kernel's draws are the spec's, token for token, and the spec's follow
    the probabilities (``tests/test_op_spec.py`` checks that part at length)."""
    probs = np.array([0.5, 0.25, 0.15, 0.1, 0.0])
    rows = 400
    logits = np.repeat(np.log(np.maximum(probs, 1e-30))[None].astype(np.float32), rows, 0)
    out = check(logits, make_sampling_batch(rows, seeds=np.arange(rows) * 7919))
    freq = np.bincount(out.token_ids, minlength=5) / rows
    np.testing.assert_allclose(freq, probs, atol=0.08)
    assert freq[4] == 0


def test_filters_at_their_edges():
    """Ties at the top-k and top-p edges stay, top_p <= the max's mass keeps only the max (and
    its ties), min_p = 1 and k = 1 keep the max's ties, a tiny temperature is greedy
    without overflow, and rows whose every token but one is suppressed draw that one."""
    vocab = 64
    base = np.linspace(-3, 3, vocab, dtype=np.float32)
    tied = base.copy()
    tied[[10, 20, 30]] = 5.0  # three tied maxima
    tied[[11, 21]] = 4.0  # two tied runners-up
    rows = [
        (tied, {"top_k": 4}),  # 3 maxima + the k-th (a tie of two at 4.0): both runners-up stay
        (tied, {"top_k": 3}),
        (tied, {"top_p": 0.0}),  # only the tied maxima
        (tied, {"top_p": 0.5}),
        (tied, {"min_p": 1.0}),
        (tied, {"top_k": 1}),
        (base * 50, {"temperature": 1e-6}),
        (base, {"suppress_token_ids": list(range(vocab - 1))}),
        (np.zeros(vocab, np.float32), {"top_p": 0.3}),  # flat: ties everywhere
        (np.zeros(vocab, np.float32), {"temperature": 0.0}),
    ]
    fields: dict[str, list] = {
        "temperature": [1.0] * len(rows),
        "top_k": [0] * len(rows),
        "top_p": [1.0] * len(rows),
        "min_p": [0.0] * len(rows),
        "suppress_token_ids": [[] for _ in rows],
    }
    for i, (_, settings) in enumerate(rows):
        for name, value in settings.items():
            fields[name][i] = value
    logits = np.stack([r for r, _ in rows])
    for seed in range(3):
        seeds = np.arange(len(rows)) + 1000 * seed
        out = check(logits, make_sampling_batch(len(rows), seeds=seeds, num_logprobs=2, **fields))
        assert all(out.token_ids[i] in (10, 20, 30) for i in (2, 4, 5))
        assert out.token_ids[9] == 0 and out.token_ids[7] == vocab - 1


def test_sample_takes_half_precision_and_strided_logits():
    rng = np.random.default_rng(3)
    logits = logits_like_a_model(rng, 4, 700)
    batch = mixed_batch(rng, 4, 700, ["top_p", "greedy", "top_k", "min_p"])
    for dtype in (torch.float16, torch.bfloat16):
        rounded = torch.from_numpy(logits).to(dtype)
        expected = spec.sample(rounded.float().numpy(), batch)
        actual = ops.sample(rounded.to(DEVICE), batch)  # read as they are, widened in the kernel
        np.testing.assert_array_equal(actual.token_ids, expected.token_ids)
        np.testing.assert_array_equal(actual.ranks, expected.ranks)
        np.testing.assert_allclose(actual.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
        wide = torch.cat([rounded, rounded], dim=1).to(DEVICE)[:, :700]  # half precision, strided rows
        np.testing.assert_array_equal(ops.sample(wide, batch).token_ids, expected.token_ids)
    wide = torch.from_numpy(np.concatenate([logits, logits], axis=1)).to(DEVICE)
    actual = ops.sample(wide[:, :700], batch)  # rows with a stride of 1400
    np.testing.assert_array_equal(actual.token_ids, spec.sample(logits, batch).token_ids)


def test_sample_leaves_the_logits_untouched_and_handles_no_rows():
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(logits_like_a_model(rng, 2, 500)).to(DEVICE)
    before = logits.clone()
    ops.sample(
        logits,
        make_sampling_batch(
            2,
            repetition_penalty=[1.5, 1.0],
            output_token_ids=[[1], [2]],
            suppress_token_ids=[[3], []],
        ),
    )
    assert torch.equal(logits, before)
    empty = ops.sample(torch.zeros(0, 500, device=DEVICE), make_sampling_batch(0, num_logprobs=2))
    assert empty.token_ids.shape == (0,) and empty.top_ids.shape == (0, 2)


def test_sample_async_is_sample_and_feeds_the_next_ids():
    """``sample_async``: ``result()`` is ``sample``'s (the spec's), the same each time it is
    called, and ``feed`` writes the sampled tokens into a later step's ids on the device,
    before the host has read them."""
    rng = np.random.default_rng(9)
    logits = logits_like_a_model(rng, 4, 3001)
    batch = mixed_batch(rng, 4, 3001, list(MODES), num_logprobs=2)
    pending = ops.sample_async(torch.from_numpy(logits).to(DEVICE), batch)
    ids = torch.tensor([-1, 5, -1, -1, 7], dtype=torch.int64, device=DEVICE)
    dest = torch.tensor([0, 2, 3], device=DEVICE)
    src = torch.tensor([3, 0, 1], device=DEVICE)
    fed = pending.feed(ids, dest, src).cpu().numpy()  # queued behind the sampling kernel
    expected = spec.sample_async(logits, batch)
    result = pending.result()
    np.testing.assert_array_equal(result.token_ids, expected.result().token_ids)
    np.testing.assert_array_equal(result.top_ids, expected.result().top_ids)
    np.testing.assert_allclose(result.logprobs, expected.result().logprobs, **spec.TOLERANCES["sample_async"])
    np.testing.assert_array_equal(fed, expected.feed(np.array([-1, 5, -1, -1, 7]), [0, 2, 3], [3, 0, 1]))
    assert pending.result() is result  # read by the grammar thread and the engine's: converted once


def test_supports_and_registration():
    assert ops.OPS["sample"] is ops.sample and ops.OPS["sample_async"] is ops.sample_async
    assert all(ops.supports("sample", d) for d in (torch.float32, torch.float16, torch.bfloat16))
    assert not ops.supports("sample", torch.int8)


# --- larger, on a device only --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("vocab", [50257, 103424, 151936])
@pytest.mark.parametrize("rows", [1, 64])
def test_sample_matches_spec_at_model_sizes(vocab, rows):
    rng = np.random.default_rng(vocab + rows)
    logits = logits_like_a_model(rng, rows, vocab)
    check(logits, mixed_batch(rng, rows, vocab, list(MODES), num_logprobs=5))
