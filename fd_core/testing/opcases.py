"""The conformance kit's op cases: each runs one implementation of one op on a backend's device
(through its Memory) and holds the result to the NumPy specification (``fd_core.testing.spec``)
at ``spec.tolerance(op, dtype)``.

Inputs are drawn in float32, uploaded in the case's dtype, and the specification is run on the
rounded values read back, so a 16-bit case measures the op and not the rounding of its inputs.
A mismatch raises :class:`OpMismatch` naming the op, the implementation, the shapes and the
error.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fd_core.engine.model_runner import StepInputs, ragged_inputs
from fd_core.interfaces import (
    AttentionMetadata,
    Capabilities,
    Memory,
    SampleOutput,
)
from fd_core.interfaces.ops import SamplingBatch, pack_token_bitmask
from fd_core.models.rope import cos_sin_table
from fd_core.plugins.ops import op_context
from fd_core.quantization.host import upload_quantized
from fd_core.quantization.kv_cache import KV_QUANTIZED, quantized_cache
from fd_core.quantization.quantize import quantize
from fd_core.testing import spec
from fd_core.testing.batches import make_sampling_batch


class OpMismatch(AssertionError):
    """An implementation disagrees with the specification beyond the stated tolerance."""


@dataclass(frozen=True)
class OpCase:
    op: str
    label: str  # the shapes and variant, e.g. "x[7, 576] + residual"
    dtype: str
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    head_dim: int | None = None
    quantization: str | None = None

    @property
    def id(self) -> str:
        return f"{self.op}-{self.dtype}-{self.label}"

    def context(self) -> dict[str, Any]:
        """What the engine passes to ``supports()`` for a model like this case."""
        return op_context(self.dtype, self.head_dim or 64, self.quantization)


def _describe(case: OpCase, impl: str) -> str:
    return f"op {case.op} (implementation {impl!r}) on {case.label}, {case.dtype}"


def compare(case: OpCase, impl: str, what: str, actual: Any, expected: Any, exact: bool = False) -> None:
    """``actual`` against the specification's ``expected``; raises OpMismatch with the largest
    error, where it is, and how many elements are out of tolerance."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    where = _describe(case, impl)
    if actual.shape != expected.shape:
        raise OpMismatch(f"{where}: {what} has shape {list(actual.shape)}, the spec's has {list(expected.shape)}")
    tol = {"rtol": 0.0, "atol": 0.0} if exact else spec.tolerance(case.op, case.dtype, case.quantization)
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - e)
        bad = ~(err <= tol["atol"] + tol["rtol"] * np.abs(e))
    bad &= ~((a == e) | (np.isnan(a) & np.isnan(e)))  # equal infinities are not errors
    if not bad.any():
        return
    worst = np.where(bad, np.nan_to_num(err, nan=np.inf), -1.0)
    idx = np.unravel_index(int(np.argmax(worst)), worst.shape)
    raise OpMismatch(
        f"{where}: {what} differs from the spec: max abs error {float(worst[idx]):.4g} at index "
        f"{list(map(int, idx))} (got {a[idx]:.6g}, spec {e[idx]:.6g}); {int(bad.sum())} of {bad.size} "
        f"elements outside rtol={tol['rtol']:g}, atol={tol['atol']:g}"
    )


class Device:
    """Moves a case's arrays to the backend and back."""

    def __init__(self, memory: Memory, dtype: str) -> None:
        self.memory, self.dtype = memory, dtype

    def put(self, array: np.ndarray, dtype: str | None = None) -> tuple[Any, np.ndarray]:
        """The uploaded tensor (floats in the case's dtype unless ``dtype``) and its exact host value."""
        array = np.ascontiguousarray(array)
        if np.issubdtype(array.dtype, np.floating):
            tensor = self.memory.from_numpy(array.astype(np.float32), dtype or self.dtype)
            return tensor, self.get(tensor)
        return self.memory.from_numpy(array), array

    def get(self, tensor: Any) -> np.ndarray:
        return np.asarray(self.memory.to_numpy(tensor))


def _randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _rng(case: OpCase) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case.id.encode()))  # stable across runs and processes


# --- one runner per op ---------------------------------------------------------------------------


def _embedding(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    vocab, hidden, n = case.params["vocab"], case.params["hidden"], case.params["n"]
    rng = _rng(case)
    table = rng.integers(-2**40, 2**40, (vocab, hidden)) if case.params.get("int64") else _randn(rng, vocab, hidden)
    weight, w = dev.put(table)
    ids, i = dev.put(rng.integers(0, vocab, n).astype(np.int64))
    compare(case, impl, "output", dev.get(fn(weight, ids)), spec.embedding(w, i), exact=True)


def _rms_norm(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    shape, with_residual = case.params["shape"], case.params["residual"]
    rng = _rng(case)
    x, xh = dev.put(_randn(rng, *shape, scale=3.0))
    weight, wh = dev.put(1 + _randn(rng, shape[-1], scale=0.3), "float32")  # norms stay float32
    residual, rh = dev.put(_randn(rng, *shape)) if with_residual else (None, None)
    out = fn(x, weight, 1e-6, residual)
    want = spec.rms_norm(xh, wh, 1e-6, rh)
    if with_residual:
        if not isinstance(out, tuple) or len(out) != 2:
            raise OpMismatch(f"{_describe(case, impl)}: with a residual the op returns (y, x + residual), "
                             f"got {type(out).__name__}")
        compare(case, impl, "y", dev.get(out[0]), want[0])
        compare(case, impl, "x + residual", dev.get(out[1]), want[1])
    else:
        compare(case, impl, "y", dev.get(out), want)


def _rotary(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    p = case.params
    rng = _rng(case)
    n, (hq, hk), d, rot, style = p["n"], p["heads"], case.head_dim, p["rotary_dim"], p["style"]
    positions, pos = dev.put(rng.integers(0, 300, n).astype(np.int64))
    q, qh = dev.put(_randn(rng, n, hq, d))
    k, kh = dev.put(_randn(rng, n, hk, d))
    table, th = dev.put(cos_sin_table(rot, 512, 10000.0), "float32")
    out = fn(positions, q, k, table, style)
    want_q, want_k = spec.rotary(pos, qh, kh, th, style)
    compare(case, impl, "q", dev.get(out[0]), want_q)
    compare(case, impl, "k", dev.get(out[1]), want_k)


def _linear(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    p = case.params
    rng = _rng(case)
    x, xh = dev.put(_randn(rng, p["n"], p["in"]))
    w = _randn(rng, p["out"], p["in"], scale=p["in"] ** -0.5)
    bias, bh = dev.put(_randn(rng, p["out"])) if p["bias"] else (None, None)
    if case.quantization:
        qw = quantize(w, case.quantization, p["group_size"], p.get("zeros", False))
        got = dev.get(fn(x, upload_quantized(qw, dev.memory), bias))
        try:
            compare(case, impl, "output", got, spec.linear(xh, qw, bh))
        except OpMismatch:
            if case.quantization != "block_wise_fp8":
                raise
            # W8A8 (API 1.6): the activations rounded to e4m3 per row and 128 columns first
            compare(case, impl, "output (weight-only, nor with FP8 activations)", got,
                    spec.linear(spec.fp8_activations(xh).astype(xh.dtype), qw, bh))
    else:
        weight, wh = dev.put(w)
        compare(case, impl, "output", dev.get(fn(x, weight, bias)), spec.linear(xh, wh, bh))


def _silu_and_mul(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    x, xh = dev.put(_randn(_rng(case), case.params["n"], 2 * case.params["inter"], scale=2.0))
    compare(case, impl, "output", dev.get(fn(x)), spec.silu_and_mul(xh))


def attention_step(rng: np.random.Generator, seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int,
                   head_dim: int) -> tuple[AttentionMetadata, tuple[np.ndarray, np.ndarray]]:
    """``attention_inputs``' metadata and caches."""
    inputs, caches = attention_inputs(rng, seqs, block_size, num_kv_heads, head_dim)
    return inputs.meta, caches


def attention_inputs(rng: np.random.Generator, seqs: list[tuple[int, int]], block_size: int, num_kv_heads: int,
                     head_dim: int) -> tuple[StepInputs, tuple[np.ndarray, np.ndarray]]:
    """A step over ``seqs`` = ``[(context_len, query_len)]`` with shuffled, non-contiguous block
    tables and a cache full of noise (the cached context included): its inputs as the engine
    builds them (positions, slots, attention metadata; the ids are unused) and the caches."""
    totals = [c + n for c, n in seqs]
    need = [-(-t // block_size) for t in totals]
    num_blocks = sum(need) * 2 + 3
    free = rng.permutation(num_blocks)
    tables = np.zeros((len(seqs), max(need)), dtype=np.int64)
    used = 0
    for i, b in enumerate(need):
        tables[i, :b] = free[used: used + b]
        used += b
    query_lens = np.array([n for _, n in seqs], dtype=np.int64)
    inputs = ragged_inputs(np.zeros(int(query_lens.sum()), dtype=np.int64), tables,
                           np.array([c for c, _ in seqs], dtype=np.int64), query_lens, block_size)
    shape = (num_blocks * block_size, num_kv_heads, head_dim)
    return inputs, (_randn(rng, *shape), _randn(rng, *shape))


def _attention(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    p = case.params
    rng = _rng(case)
    (hq, hk), d = p["heads"], case.head_dim
    meta, (key_cache, value_cache) = attention_step(rng, p["seqs"], p["block_size"], hk, d)
    shift = p.get("value_mean", 0.0)  # values of mean 1: outputs of order 1 over long contexts
    value_cache = value_cache + np.float32(shift)
    if p.get("kv_cache_dtype"):  # a quantized cache (fd_core.quantization.kv_cache's format)
        key_cache, value_cache = (quantized_cache(c, p["kv_cache_dtype"], p["block_size"])
                                  for c in (key_cache, value_cache))
    n = int(meta.query_start_loc[-1])
    q, qh = dev.put(_randn(rng, n, hq, d))
    k, kh = dev.put(_randn(rng, n, hk, d))
    v, vh = dev.put(_randn(rng, n, hk, d) + np.float32(shift))
    (kc, kch), (vc, vch) = dev.put(key_cache), dev.put(value_cache)
    scale = d**-0.5
    out = fn(q, k, v, (kc, vc), meta, scale)
    want = spec.attention(qh, kh, vh, (kch, vch), meta, scale)  # writes kch, vch in place
    compare(case, impl, "output", dev.get(out), want)
    compare(case, impl, "key cache after the write", dev.get(kc), kch, exact=True)
    compare(case, impl, "value cache after the write", dev.get(vc), vch, exact=True)


def _rotary_attention(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    p = case.params
    rng = _rng(case)
    (hq, hk), d, rot, style = p["heads"], case.head_dim, p["rotary_dim"], p["style"]
    step, (key_cache, value_cache) = attention_inputs(rng, p["seqs"], p["block_size"], hk, d)
    meta = step.meta
    n = int(meta.query_start_loc[-1])
    positions, pos = dev.put(step.positions)  # each new token's
    q, qh = dev.put(_randn(rng, n, hq, d))
    k, kh = dev.put(_randn(rng, n, hk, d))
    v, vh = dev.put(_randn(rng, n, hk, d))
    table, th = dev.put(cos_sin_table(rot, 512, 10000.0), "float32")
    (kc, kch), (vc, vch) = dev.put(key_cache), dev.put(value_cache)
    scale = d**-0.5
    out = fn(positions, q, k, v, table, style, (kc, vc), meta, scale)
    # the rotated q and k the spec computes, rounded to the case's dtype as the rotary op's are
    rq, rk = (dev.get(dev.put(x)[0]) for x in spec.rotary(pos, qh, kh, th, style))
    want = spec.attention(rq, rk, vh, (kch, vch), meta, scale)  # writes kch, vch in place
    compare(case, impl, "output", dev.get(out), want)
    compare(case, impl, "key cache after the write", dev.get(kc), kch)
    compare(case, impl, "value cache after the write", dev.get(vc), vch, exact=True)


def _moe(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    p = case.params
    rng = _rng(case)
    e, h, inter = p["experts"], p["hidden"], p["inter"]
    x, xh = dev.put(_randn(rng, p["n"], h))
    router, rh = dev.put(_randn(rng, e, h))
    # scaled by fan-in: intermediates of order one, so a 16-bit kernel's rounding of them (the
    # contract allows it) is measured against outputs of order one
    gate_up = [_randn(rng, 2 * inter, h, scale=h**-0.5) for _ in range(e)]
    down = [_randn(rng, h, inter, scale=inter**-0.5) for _ in range(e)]
    method = p.get("experts_quantized")  # experts in a declared method's canonical form
    if method:
        group = {"wint8": -1, "wint4": 16}.get(method, 128)
        gate_up, down = ([quantize(w, method, group) for w in ws] for ws in (gate_up, down))
        gate_up, down = ([(upload_quantized(q, dev.memory), q) for q in ws] for ws in (gate_up, down))
    else:
        gate_up, down = ([dev.put(w) for w in ws] for ws in (gate_up, down))
    bias, bh = dev.put(_randn(rng, e, scale=0.5), "float32") if p["bias"] else (None, None)
    # expert parallelism: this rank holds experts first .. first + count - 1 only
    first, count = p.get("local", (0, e))
    local = slice(first, first + count)
    extra = {"expert_offset": first} if "local" in p else {}
    out = fn(x, router, [g[0] for g in gate_up[local]], [g[0] for g in down[local]], p["top_k"], p["scoring"],
             p["renormalize"], bias, **extra)
    want = spec.moe(xh, rh, [g[1] for g in gate_up[local]], [g[1] for g in down[local]], p["top_k"], p["scoring"],
                    p["renormalize"], bh, **extra)
    compare(case, impl, "output", dev.get(out), want)


def sampling_batch(case: OpCase, rng: np.random.Generator, rows: int, vocab: int, logits: np.ndarray):
    kind = case.params["kind"]

    def pick(options: list) -> list:
        return [options[i] for i in rng.integers(0, len(options), rows)]

    def tokens(most: int) -> list[np.ndarray]:
        return [rng.integers(0, vocab, int(rng.integers(0, most))) for _ in range(rows)]

    common = dict(seeds=rng.integers(0, 2**62, rows), steps=rng.integers(0, 1000, rows),
                  num_logprobs=case.params.get("logprobs", 0))
    if kind == "greedy":
        return make_sampling_batch(rows, temperature=[0.0] * rows, **common)
    if kind == "filters":
        return make_sampling_batch(rows, temperature=pick([0.0, 0.3, 1.0, 1.7]), top_k=pick([0, 1, 5, 40, vocab]),
                                   top_p=pick([1.0, 0.9, 0.5, 0.05]), min_p=pick([0.0, 0.05, 0.3]), **common)
    if kind == "grammar":  # structured output: a token bitmask over filtered and penalised rows
        batch = make_sampling_batch(rows, temperature=pick([0.0, 0.7, 1.3]), top_k=pick([0, 3, 40]),
                                    top_p=pick([1.0, 0.8]), repetition_penalty=pick([1.0, 1.2]),
                                    output_token_ids=tokens(10), suppress_token_ids=tokens(3), **common)
        allowed = np.zeros((rows, vocab), dtype=bool)
        allowed[0] = True  # a row without a grammar: every bit set
        allowed[1] = False
        allowed[1, int(rng.integers(0, vocab))] = True  # the grammar's only choice
        allowed[2] = rng.random(vocab) < 0.05
        allowed[2, vocab - 1] = True  # the last word's padding bits stay clear
        for i in range(3, rows):
            allowed[i] = rng.random(vocab) < (0.5, 0.1, 0.01)[i % 3]
            allowed[i, int(rng.integers(0, vocab))] = True
        for i, ids in enumerate(batch.suppress_token_ids):  # a grammar never leaves only suppressed ids
            free = np.setdiff1d(np.flatnonzero(allowed[i]), ids)
            if not len(free):
                allowed[i, np.setdiff1d(np.arange(vocab), ids)[0]] = True
        batch.allowed_token_bitmask = pack_token_bitmask(allowed)
        return batch
    if kind == "logit_bias":
        return _biased_batch(rng, logits, common)
    return make_sampling_batch(  # penalties and suppression, greedy and random rows
        rows, temperature=pick([0.0, 0.8]), presence_penalty=pick([0.0, 0.5, -0.3]),
        frequency_penalty=pick([0.0, 0.2]), repetition_penalty=pick([1.0, 1.3, 0.8]),
        prompt_token_ids=tokens(12), output_token_ids=tokens(20), suppress_token_ids=tokens(4), **common)


def _biased_batch(rng: np.random.Generator, logits: np.ndarray, common: dict) -> SamplingBatch:
    """OpenAI's logit_bias (API 1.11) on 8 rows, each a way to get it wrong: 0 and 7 have none
    (beside rows that do); 1 is greedy, flipped to its fifth best token by a bias just large
    enough; 2 bans its argmax with -100; 3 is greedy with its argmax seen under a repetition
    penalty of 2 and biased so that the runner-up wins only if the bias comes before the penalty
    (vLLM's order); 4 is filtered and penalised, 64 tokens biased either way; 5 has a grammar
    whose mask must beat a +100 bias, its allowed tokens raised; 6 draws with +100 on a
    suppressed token."""
    rows, vocab = logits.shape
    order = np.argsort(-logits, axis=1, kind="stable")
    bias: list[tuple[Any, Any]] = [([], [])] * rows

    def row_bias(i: int, ids: list[int] | np.ndarray, values: list[float] | np.ndarray) -> None:
        bias[i] = (ids, values)

    fifth = order[1, 4]
    row_bias(1, [fifth, order[1, 0]], [logits[1, order[1, 0]] - logits[1, fifth] + 0.5, -0.25])
    row_bias(2, [order[2, 0]], [-100.0])
    best, second = logits[3, order[3, 0]], logits[3, order[3, 1]]
    # after the bias then the penalty, (best + b) / 2 < second; the other way, best / 2 + b > second
    row_bias(3, [order[3, 0]], [1.5 * second - 0.75 * best])
    row_bias(4, rng.choice(vocab, 64, replace=False), rng.uniform(-8, 8, 64))
    allowed = np.ones((rows, vocab), dtype=bool)
    allowed[5] = rng.random(vocab) < 0.1
    banned, raised = np.flatnonzero(~allowed[5])[:1], np.flatnonzero(allowed[5])[-3:]
    row_bias(5, np.concatenate([banned, raised]), [100.0, 5.0, 12.0, -3.0])
    suppressed = order[6, :3]
    row_bias(6, [suppressed[0], order[6, 10]], [100.0, 2.0])
    tokens = [[]] * rows
    tokens[3] = [int(order[3, 0])]
    tokens[4] = list(rng.integers(0, vocab, 12))
    batch = make_sampling_batch(
        rows, temperature=[0.0, 0.0, 0.0, 0.0, 0.8, 0.0, 1.0, 1.3], top_k=[0, 0, 0, 0, 40, 0, 0, 0],
        top_p=[1.0, 1.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0], min_p=[0.0] * 7 + [0.05],
        repetition_penalty=[1.0, 1.0, 1.0, 2.0, 1.3, 1.0, 1.0, 1.0],
        presence_penalty=[0.0] * 4 + [0.5] + [0.0] * 3, frequency_penalty=[0.0] * 4 + [0.2] + [0.0] * 3,
        output_token_ids=tokens, suppress_token_ids=[[]] * 6 + [suppressed] + [[]], logit_bias=bias, **common)
    batch.allowed_token_bitmask = pack_token_bitmask(allowed)
    return batch


def _compare_samples(case: OpCase, impl: str, got: SampleOutput, want: SampleOutput) -> None:
    compare(case, impl, "token_ids", got.token_ids, want.token_ids, exact=True)
    compare(case, impl, "logprobs", got.logprobs, want.logprobs)
    compare(case, impl, "ranks", got.ranks, want.ranks, exact=True)
    compare(case, impl, "top_ids", got.top_ids, want.top_ids, exact=True)
    compare(case, impl, "top_logprobs", got.top_logprobs, want.top_logprobs)


def _sample(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    rows, vocab = case.params["rows"], case.params["vocab"]
    rng = _rng(case)
    logits, lh = dev.put(_randn(rng, rows, vocab, scale=2.0))
    batch = sampling_batch(case, rng, rows, vocab, lh)
    got = fn(logits, batch)
    if case.op == "sample_async":
        ids, _ = dev.put(np.full(rows + 2, -1, np.int64))
        dest, src = np.arange(rows, dtype=np.int64)[::-1] + 1, np.arange(rows, dtype=np.int64)
        fed = dev.get(got.feed(ids, dev.put(dest)[0], dev.put(src)[0]))
        got = got.result()
        want_ids = np.full(rows + 2, -1, np.int64)
        want_ids[dest] = got.token_ids[src]
        compare(case, impl, "feed()'s ids", fed, want_ids, exact=True)
    _compare_samples(case, impl, got, spec.sample(lh, batch))


def _deferred_bitmask(case: OpCase, fn: Callable, dev: Device, impl: str, sample_async: Callable) -> None:
    """The grammar case through ``sample_async`` with a mask from ``fn`` (``deferred_bitmask``)
    that is written only after the sample was queued: a wrong mask first, the right one after
    ``sample_async`` returned, then ``ready()``. The tokens must be the right mask's, and
    ``sample_async`` must not have waited for ``ready()`` (a watchdog releases the device after
    ``DEFERRED_PATIENCE`` seconds so that a backend that waits fails instead of hanging)."""
    rows, vocab = case.params["rows"], case.params["vocab"]
    rng = _rng(case)
    logits, lh = dev.put(_randn(rng, rows, vocab, scale=2.0))
    batch = sampling_batch(case, rng, rows, vocab, lh)
    right = batch.allowed_token_bitmask
    # first the plain mask: the kernels load now, not behind the wait (where a device may
    # hold the queuing thread until ready(): the op's contract)
    sample_async(logits, batch).result()
    mask = fn(rows, right.shape[1])
    if mask.array.shape != right.shape or mask.array.dtype != np.int32:
        raise OpMismatch(f"{_describe(case, impl)}: the deferred array is {mask.array.dtype} "
                         f"{list(mask.array.shape)}, not int32 {list(right.shape)}")
    wrong = np.zeros((rows, vocab), dtype=bool)
    wrong[np.arange(rows), np.argmin(lh, axis=1)] = True  # each row's least likely token alone
    mask.array[...] = pack_token_bitmask(wrong)
    watchdog = threading.Timer(DEFERRED_PATIENCE, mask.ready)
    watchdog.start()
    try:
        pending = sample_async(logits, dataclasses.replace(batch, allowed_token_bitmask=mask))
        waited = watchdog.finished.is_set()  # it fired: sample_async returned only after ready()
        mask.array[...] = right
        mask.ready()
        got = pending.result()
    finally:
        watchdog.cancel()
    if waited:
        raise OpMismatch(f"{_describe(case, impl)}: sample_async waited for the deferred bitmask's ready()")
    _compare_samples(case, impl, got, spec.sample(lh, batch))


DEFERRED_PATIENCE = 30.0


def _token_logprobs(case: OpCase, fn: Callable, dev: Device, impl: str) -> None:
    rows, vocab, k = case.params["rows"], case.params["vocab"], case.params["logprobs"]
    rng = _rng(case)
    x = _randn(rng, rows, vocab, scale=2.0)
    x[1::2] = np.round(x[1::2])  # rows of many equal logits: ranks and top ids decide ties
    logits, lh = dev.put(x)
    ids = rng.integers(0, vocab, rows).astype(np.int64)
    ids[0] = np.argmax(lh[0])  # a token that is its row's best
    tokens, ih = dev.put(ids)
    _compare_samples(case, impl, fn(logits, tokens, k), spec.token_logprobs(lh, ih, k))


RUNNERS: dict[str, Callable[[OpCase, Callable, Device, str], None]] = {
    "embedding": _embedding, "rms_norm": _rms_norm, "rotary": _rotary, "linear": _linear,
    "silu_and_mul": _silu_and_mul, "attention": _attention, "rotary_attention": _rotary_attention, "moe": _moe,
    "sample": _sample, "sample_async": _sample, "token_logprobs": _token_logprobs,
}


def run_case(case: OpCase, fn: Callable, memory: Memory, impl: str = "",
             sample_async: Callable | None = None) -> None:
    """Run ``fn`` (an implementation of ``case.op``) on the case; raises OpMismatch.
    ``deferred_bitmask`` is run through the backend's ``sample_async``."""
    if case.op == "deferred_bitmask":
        if sample_async is None:
            raise OpMismatch(f"{_describe(case, impl)}: the backend has deferred_bitmask but no sample_async to use it")
        _deferred_bitmask(case, fn, Device(memory, case.dtype), impl, sample_async)
        return
    RUNNERS[case.op](case, fn, Device(memory, case.dtype), impl)


# --- the grid ------------------------------------------------------------------------------------

ATTENTION_STEPS = {
    "prefill": [(0, 7), (0, 3)],
    "decode": [(6, 1), (1, 1), (17, 1), (40, 1)],
    # whole prompts beside decodes: the scheduler mixes them even with chunked prefill off
    "prefill+decode": [(0, 5), (9, 1), (0, 3), (20, 1)],
    # only where the backend declares chunked prefill or prefix caching: queries after a context
    "prefix": [(16, 5), (32, 1), (0, 4)],
    "mixed": [(0, 5), (9, 1), (4, 3), (20, 1), (33, 2)],
    "long": [(0, 150), (37, 70), (100, 1)],
}


# method -> (rows, in, out, group size, zeros): each group form a loader makes (per channel; the
# wint4 default of 128; GGUF's 32 with minimums), one row to a 512-token prefill
QUANTIZED_LINEAR = {
    "wint8": [(1, 256, 64, -1, False), (5, 128, 48, 64, False), (5, 128, 48, 32, True), (512, 256, 64, -1, False)],
    "wint4": [(1, 256, 64, 128, False), (5, 128, 48, -1, False), (5, 128, 48, 32, True),
              (512, 256, 64, 128, False)],
    # 200 x 320: partial 128 x 128 blocks at both edges; 64 x 512 x 256: whole ones, which a
    # backend may run as W8A8 (activations rounded to e4m3, spec.fp8_activations)
    "block_wise_fp8": [(1, 320, 200, 128, False), (37, 320, 200, 128, False), (512, 256, 128, 128, False),
                       (64, 512, 256, 128, False)],
}


# Long reductions, where a sum kept in a 16-bit type drifts out of tolerance and a float32 one
# does not (spec.HALF_TOLERANCES gives the arithmetic). Each is as wide as real models reduce:
# a 4,096- and a 16,384-term dot product (hidden and MLP sizes of 7B-70B models), the sum of
# squares over a hidden size of 8,192 (all terms positive: in bfloat16 the sum stops growing
# once a term is below 2**-9 of it), and decodes over a 4,095- and a 2,047-token context with
# values of mean 1, so the outputs are of order 1 and a relative error in the softmax's sums
# shows above the tolerance's atol. Many outputs each: an error of random sign lands outside
# the tolerance on some of them.
LONG_LINEAR = [(16, 4096, 256), (4, 16384, 64)]  # (rows, in, out)
LONG_RMS_NORM = [(4, 8192)]
LONG_DECODE = [(4095, 1), (2047, 1)]


def cases(capabilities: Capabilities, ops: set[str] | None = None) -> list[OpCase]:
    """Every case the backend's manifest calls for: each op in every declared dtype; linear in
    every declared quantization method; attention on queries after a cached context only where
    chunked prefill or prefix caching is declared."""
    out: list[OpCase] = []
    chunked = capabilities.chunked_prefill or capabilities.prefix_caching
    for dtype in sorted(capabilities.dtypes):
        def add(op: str, label: str, **kw: Any) -> None:
            out.append(OpCase(op, label, dtype, **kw))

        for vocab, hidden, n in [(64, 32, 1), (500, 96, 37)]:
            add("embedding", f"weight[{vocab}, {hidden}] ids[{n}]", params=dict(vocab=vocab, hidden=hidden, n=n))
        # tensor parallelism maps token ids to a rank's embedding rows through an int64 table,
        # with the embedding chosen for the model's dtype: a case in each
        add("embedding", "int64 weight[300, 1] ids[37]", params=dict(vocab=300, hidden=1, n=37, int64=True))
        for shape in [(1, 64), (7, 576), (2, 3, 128), *LONG_RMS_NORM]:
            for residual in (False, True):
                add("rms_norm", f"x{list(shape)}" + (" + residual" if residual else "")
                    + (", a long reduction" if shape in LONG_RMS_NORM else ""),
                    params=dict(shape=shape, residual=residual))
        for style in ("neox", "interleaved"):
            for d, rot, heads, n in [(64, 64, (4, 4), 11), (128, 128, (8, 2), 11), (64, 32, (8, 2), 5),
                                     (128, 64, (4, 4), 1)]:
                add("rotary", f"{style} q[{n}, {heads[0]}, {d}] k[{n}, {heads[1]}, {d}] rotary_dim {rot}",
                    head_dim=d, params=dict(style=style, rotary_dim=rot, heads=heads, n=n))
        for n, fin, fout, bias in [(1, 64, 32, False), (9, 128, 96, True), (33, 576, 192, False)]:
            add("linear", f"x[{n}, {fin}] weight[{fout}, {fin}]" + (" + bias" if bias else ""),
                params=dict(n=n, **{"in": fin, "out": fout}, bias=bias))
        for method in sorted(capabilities.quantization):
            for n, fin, fout, group, zeros in QUANTIZED_LINEAR[method]:
                add("linear", f"x[{n}, {fin}] {method} weight[{fout}, {fin}] group {group}"
                    + (" + zeros" if zeros else "") + " + bias", quantization=method,
                    params=dict(n=n, **{"in": fin, "out": fout}, bias=True, group_size=group, zeros=zeros))
        for n, fin, fout in LONG_LINEAR:
            add("linear", f"x[{n}, {fin}] weight[{fout}, {fin}], a long reduction",
                params=dict(n=n, **{"in": fin, "out": fout}, bias=False))
        for n, inter in [(1, 8), (5, 64), (33, 1536)]:
            add("silu_and_mul", f"x[{n}, {2 * inter}]", params=dict(n=n, inter=inter))
        if dtype in capabilities.kv_cache_dtypes:
            for name, seqs in ATTENTION_STEPS.items():
                if name in ("prefix", "mixed", "long") and not chunked:
                    continue
                for heads, d in [((4, 4), 64), ((8, 2), 128)]:
                    add("attention", f"{name} step {seqs} q heads {heads[0]} kv heads {heads[1]} head_dim {d} "
                        f"block_size 16", head_dim=d, params=dict(seqs=seqs, heads=heads, block_size=16))
            add("attention", f"long-context decode step {LONG_DECODE} q heads 8 kv heads 2 head_dim 128 "
                f"block_size 16, values of mean 1", head_dim=128,
                params=dict(seqs=LONG_DECODE, heads=(8, 2), block_size=16, value_mean=1.0))
            for style, (heads, d, rot), name in [("neox", ((8, 2), 128, 128), "prefill+decode"),
                                                 ("interleaved", ((4, 4), 64, 32), "decode")]:
                seqs = ATTENTION_STEPS[name]
                add("rotary_attention", f"{style} {name} step {seqs} q heads {heads[0]} kv heads {heads[1]} "
                    f"head_dim {d} rotary_dim {rot} block_size 16", head_dim=d,
                    params=dict(seqs=seqs, heads=heads, block_size=16, style=style, rotary_dim=rot))
        for kv in sorted(capabilities.kv_cache_dtypes & KV_QUANTIZED.keys()):
            for name in ("prefill+decode", "mixed" if chunked else "decode"):
                seqs = ATTENTION_STEPS[name]
                add("attention", f"{name} step {seqs} q heads 8 kv heads 2 head_dim 64 block_size 16, "
                    f"{kv} cache", head_dim=64, params=dict(seqs=seqs, heads=(8, 2), block_size=16, kv_cache_dtype=kv))
        for experts, top_k, scoring, bias, renorm, local in [
            (4, 2, "softmax", False, True, None), (8, 2, "sigmoid", True, False, None),
            (16, 1, "softmax", False, True, None), (16, 8, "softmax", True, True, None),
            # expert parallelism: experts 4 and 5 of 8 on this rank; most tokens choose neither
            (8, 2, "softmax", True, True, (4, 2)), (8, 2, "sigmoid", False, False, (0, 4)),
        ]:
            add("moe", f"x[7, 32] {experts} experts top-{top_k} {scoring}" + (" + correction bias" if bias else "")
                + (" renormalized" if renorm else "")
                + (f", experts {local[0]}..{local[0] + local[1] - 1} local" if local else ""),
                params=dict(n=7, hidden=32, inter=48, experts=experts, top_k=top_k, scoring=scoring, bias=bias,
                            renormalize=renorm, **({"local": local} if local else {})))
        # ~37 pairs an expert: several blocks of one expert in a kernel that tiles by expert
        add("moe", "x[150, 64] 8 experts top-2 softmax + correction bias renormalized",
            params=dict(n=150, hidden=64, inter=96, experts=8, top_k=2, scoring="softmax", bias=True,
                        renormalize=True))
        for method in sorted(capabilities.quantization):
            # --quantization reaches the routed experts too: moe gets them in the canonical form
            add("moe", f"x[7, 32] 8 experts top-2 softmax, {method} experts", quantization=method,
                params=dict(n=7, hidden=32, inter=48, experts=8, top_k=2, scoring="softmax", bias=False,
                            renormalize=True, experts_quantized=method))
        for op in ("sample", "sample_async"):
            for kind, rows, vocab, logprobs in [("greedy", 5, 1000, 0), ("filters", 8, 1000, 5),
                                                ("penalties", 8, 300, 1), ("grammar", 8, 1003, 3),
                                                ("logit_bias", 8, 1000, 2)]:
                add(op, f"{kind} logits[{rows}, {vocab}]" + (f" top {logprobs} logprobs" if logprobs else ""),
                    params=dict(kind=kind, rows=rows, vocab=vocab, logprobs=logprobs))
        add("deferred_bitmask", "grammar logits[8, 1003] top 3 logprobs, mask written after sample_async",
            params=dict(kind="grammar", rows=8, vocab=1003, logprobs=3))
        for rows, vocab, logprobs in [(1, 1000, 0), (37, 1000, 5), (6, 1003, 20)]:
            add("token_logprobs", f"logits[{rows}, {vocab}] top {logprobs} logprobs, tied rows",
                params={"rows": rows, "vocab": vocab, "logprobs": logprobs})
    return [c for c in out if ops is None or c.op in ops]
