"""The op contract: names, signatures and semantics of every op a model may call.

An implementation is a plain callable with the signature written in its spec. Tensors are the
runtime's (``T``); host-side arguments are NumPy arrays or Python scalars. Shapes use
``N`` = tokens in the step, ``S`` = sequences in the step, ``H`` = hidden size, ``Hq``/``Hk`` =
query/key-value heads, ``D`` = head size, ``V`` = vocabulary size, ``E`` = experts.

The executable specification of each op is its NumPy reference in ``fd_core.testing.spec``;
where this text and that code disagree, the code is right and this text is a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

Tensor = Any


@dataclass(frozen=True)
class OpSpec:
    name: str
    signature: str
    doc: str
    optional: bool = False  # the engine works without it (and uses it where a backend has it)


QUANTIZATION_METHODS = ("wint8", "wint4", "block_wise_fp8")

# Optional ops that do the work of several: each stands in for its parts only where the package
# that made it serves every part chosen (a pin or a fallback elsewhere keeps the parts).
FUSED_OPS: dict[str, tuple[str, ...]] = {"rotary_attention": ("rotary", "attention")}
FP8_BLOCK = 128  # block_wise_fp8: one scale per 128 x 128 block of the weight


@dataclass
class QuantizedWeight:
    """A quantized linear weight, canonical layout ``[out, in]`` before any packing.

    ``method``:

    - ``"wint8"``: ``qweight`` int8; ``scales`` float32 ``[out, in // group_size]``
      (``group_size == -1``: one group spanning ``in``; otherwise ``in`` is a multiple of it).
    - ``"wint4"``: values in ``[-8, 7]``, stored one per int8; scales as for wint8.
    - ``"block_wise_fp8"``: ``qweight`` the float8 e4m3fn bit patterns as uint8 (NumPy and some
      runtimes have no float8 type; a runtime that has one views the bytes as it) or, after a
      backend's ``pack_linear``, whatever its layout says;
      ``scales`` float32 ``[ceil(out / 128), ceil(in / 128)]``, one per 128 x 128 block
      (``group_size`` is 128).

    ``zeros`` (wint8 and wint4 only; None for symmetric weights): float32, the shape of
    ``scales``, added after scaling. It carries the minimum of asymmetric formats (GGUF's Q4_1
    and Q4_K) exactly.

    Dequantized ``w[o, i] = qweight[o, i] * s + z`` with ``s``, ``z`` the scale and zero of the
    group (or block) that holds ``[o, i]``.

    ``layout`` is ``""`` for this canonical form. A backend whose ``linear`` wants another (packed
    nibbles, a kernel's tile order) returns it from its ``pack_linear`` op under a name of its
    own; only that backend's ``linear`` reads it, and ``qweight``/``scales``/``zeros`` then hold
    whatever that layout says.
    """

    method: str
    qweight: Tensor
    scales: Tensor
    group_size: int = -1
    shape: tuple[int, int] = (0, 0)
    zeros: Tensor | None = None
    layout: str = ""


@dataclass
class AttentionMetadata:
    """Where the tokens of one step sit in the paged KV cache. Built once per step by the model
    runner and shared by every layer.

    Tokens of a step are laid out sequence after sequence; sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``. Its first ``context_lens[i]`` tokens are already
    in the cache (a cached prefix or earlier prefill chunks); the new tokens follow them, so the
    total length is ``seq_lens[i] = context_lens[i] + query_len``. New token ``j`` of sequence ``i``
    is at position ``context_lens[i] + j`` and attends causally to positions ``0..that``.

    Host arrays (NumPy, int64): ``query_start_loc [S+1]``, ``seq_lens [S]``, ``context_lens [S]``,
    ``block_tables [S, max_blocks]`` (padded with 0), ``slot_mapping [N]`` (cache slot of each new
    token: ``block_tables[i][p // block_size] * block_size + p % block_size``).

    ``device`` is a per-step scratch dict in which an implementation may keep device copies of
    these arrays, so that the copy happens once per step rather than once per layer.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    block_size: int
    device: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.query_start_loc)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, host side. Row ``i`` samples from ``logits[i]``.

    ``temperature == 0`` means greedy. ``top_k <= 0`` or ``>= V`` disables top-k; ``top_p == 1``
    and ``min_p == 0`` disable theirs. Penalties follow vLLM/OpenAI: ``repetition_penalty`` (1 =
    off) divides positive and multiplies negative logits of every token seen in the prompt or the
    output; ``frequency_penalty`` subtracts ``count_in_output * f``; ``presence_penalty`` subtracts
    ``p`` once for every token present in the output. ``logit_bias`` (API 1.11; None: no row has
    one) holds per row ``(ids, values)``, int64 token ids (distinct, each below V) and float32
    biases added to those logits (OpenAI's ``logit_bias``; a row without one has two empty
    arrays): first, before the penalties, as vLLM applies it, so the repetition penalty scales
    the biased logit. ``suppress_token_ids[i]`` get ``-inf`` (used for ``min_tokens``), whatever
    their bias. ``allowed_token_bitmask`` (API 1.10; None: no constraint) is int32
    ``[S, ceil(V / 32)]``, bit ``t % 32`` of word ``t // 32`` set where row ``i`` may sample token
    ``t`` (structured output's grammar): every other token gets ``-inf`` after the bias,
    penalties and suppression, so it is never sampled, however large its bias; a row with no
    constraint has every bit set (``pack_token_bitmask``). Raw logprobs, ranks and top logprobs
    stay those of the unbiased, unmasked model distribution, as with suppression. The engine
    hands neither field to a sample op whose package declares an API older than the one that
    added it: it refuses those requests instead (``OpTable.lacks``). Given to ``sample_async``,
    the bitmask may be what the backend's ``deferred_bitmask`` made (API 1.12). Randomness is the
    counter-based noise of ``OP_SPECS["sample"]``, a function of ``(seeds[i], steps[i], token
    id)`` only, so a seeded row gives the same token whatever else is in the batch. Seeds are in
    ``[0, 2**63)``; a step enters by its low 32 bits.
    """

    temperature: np.ndarray  # float32 [S]
    top_p: np.ndarray  # float32 [S]
    top_k: np.ndarray  # int64 [S]
    min_p: np.ndarray  # float32 [S]
    presence_penalty: np.ndarray  # float32 [S]
    frequency_penalty: np.ndarray  # float32 [S]
    repetition_penalty: np.ndarray  # float32 [S]
    seeds: np.ndarray  # int64 [S]
    steps: np.ndarray  # int64 [S], the index of the token being sampled in its sequence
    # per row, for the penalties; empty in a row without any (its output may end in a token not
    # on the host yet, under asynchronous scheduling)
    prompt_token_ids: list[np.ndarray]  # for the repetition penalty
    output_token_ids: list[np.ndarray]  # for all three penalties
    suppress_token_ids: list[np.ndarray]  # per row
    num_logprobs: int = 0  # top logprobs to return per row (0: only the sampled token's)
    # int32 [S, ceil(V/32)] (API 1.10), or a DeferredBitmask for sample_async (API 1.12)
    allowed_token_bitmask: Any = None
    logit_bias: list[tuple[np.ndarray, np.ndarray]] | None = None  # per row (int64 ids, float32 biases) (API 1.11)

    @property
    def needs_penalties(self) -> bool:
        return bool(
            np.any(self.presence_penalty != 0)
            or np.any(self.frequency_penalty != 0)
            or np.any(self.repetition_penalty != 1)
        )

    @property
    def needs_suppression(self) -> bool:
        """Whether some row has tokens to suppress (``suppress_token_ids``)."""
        return any(len(t) for t in self.suppress_token_ids)


def token_bitmask_words(vocab: int) -> int:
    """Words (int32) of one row of a token bitmask over ``vocab`` tokens."""
    return (vocab + 31) // 32


def pack_token_bitmask(allowed: np.ndarray) -> np.ndarray:
    """Bool ``[S, V]`` (True: may be sampled) as ``SamplingBatch.allowed_token_bitmask``."""
    rows, vocab = allowed.shape
    padded = np.zeros((rows, token_bitmask_words(vocab) * 32), dtype=bool)
    padded[:, :vocab] = allowed
    bits = np.packbits(padded.reshape(rows, -1, 32), axis=-1, bitorder="little")  # [S, W, 4] bytes
    return np.ascontiguousarray(bits).view("<u4").reshape(rows, -1).view(np.int32)


def unpack_token_bitmask(words: np.ndarray, vocab: int) -> np.ndarray:
    """``allowed_token_bitmask`` back to bool ``[S, V]``."""
    rows = words.shape[0]
    as_bytes = np.ascontiguousarray(words.astype("<i4")).view(np.uint8).reshape(rows, -1)
    return np.unpackbits(as_bytes, axis=-1, bitorder="little")[:, :vocab].astype(bool)


@dataclass
class SampleOutput:
    """``token_ids [S]`` int64; ``logprobs [S]`` float32 of the sampled token under the raw
    (unprocessed) model distribution; ``top_ids``/``top_logprobs [S, num_logprobs]`` the highest
    raw log-probabilities, best first; ``ranks [S]`` the 1-based rank of the sampled token."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class PendingSample(Protocol):
    """What ``sample_async`` returns: a step's sample whose tokens may not be on the host yet."""

    def feed(self, ids: Tensor, dest: Tensor, src: Tensor) -> Tensor:
        """``ids`` (``T[N]`` int64) with ``ids[dest[j]] = token_ids[src[j]]``, as device work
        ordered after the sampling: the next step's input tokens, never read by the host."""
        ...

    def result(self) -> SampleOutput:
        """The SampleOutput, once it has reached the host (waits for it). It may be called
        more than once, and from another thread than the one that queued the sample (API 1.12:
        the engine's grammar thread reads the tokens too)."""
        ...


class DeferredBitmask(Protocol):
    """What ``deferred_bitmask`` returns (API 1.12): a step's allowed-token bitmask that the
    host fills after the step's ``sample_async`` is queued."""

    array: np.ndarray  # int32 [S, W], C-contiguous, written by the host before ready()

    def ready(self) -> None:
        """``array`` is filled: the device may read it. Called once, from any thread."""
        ...


def _spec(name: str, signature: str, doc: str, optional: bool = False) -> OpSpec:
    return OpSpec(name=name, signature=signature, doc=doc.strip(), optional=optional)


OP_SPECS: dict[str, OpSpec] = {
    s.name: s
    for s in [
        _spec(
            "embedding",
            "embedding(weight: T[V, H], ids: T[N] int64) -> T[N, H]",
            "Row lookup: out[n] = weight[ids[n]]. Also used to gather rows of any 2-D tensor, int64 "
            "included (API 1.17: tensor parallelism maps token ids to a rank's rows through an int64 table).",
        ),
        _spec(
            "rms_norm",
            "rms_norm(x: T[..., H], weight: T[H], eps: float, residual: T[..., H] | None = None)"
            " -> T | tuple[T, T]",
            """
            y = x / sqrt(mean(x**2, -1) + eps) * weight, computed in float32.
            With ``residual``: first x = x + residual, then return (y, x) so the caller keeps the
            summed stream as the next residual. As in vLLM, the sum is formed in float32 and both
            results come back in x's dtype.
            """,
        ),
        _spec(
            "rotary",
            "rotary(positions: T[N] int64, q: T[N, Hq, D], k: T[N, Hk, D], cos_sin: T[P, R],"
            " style: str) -> tuple[T, T]",
            """
            Rotary position embedding over the first R dims of each head (R <= D, R even); the rest
            pass through. ``cos_sin[p] = concat(cos(p * inv_freq), sin(p * inv_freq))`` with
            ``inv_freq`` of length R/2. ``style="neox"`` rotates pairs (i, i + R/2);
            ``style="interleaved"`` rotates pairs (2i, 2i+1) (GPT-J / ERNIE / GGUF Llama).
            """,
        ),
        _spec(
            "linear",
            "linear(x: T[N, in], weight: T[out, in] | QuantizedWeight, bias: T[out] | None = None)"
            " -> T[N, out]",
            """
            y = x @ weight.T + bias. A QuantizedWeight is dequantized as its docstring says; an
            implementation may compute in lower precision than that (int8 or bfloat16
            activations, as llama.cpp and the GPU kernels do) within the tolerance the
            conformance kit states for quantized cases. It is selected per quantization method:
            the engine asks ``supports(quantization=method)`` once for each method its weights
            use (and ``quantization=None`` for plain weights), so a backend may serve wint4 with a
            kernel of its own and leave wint8 to the reference.
            """,
        ),
        _spec(
            "pack_linear",
            "pack_linear(weight: QuantizedWeight) -> QuantizedWeight",
            """
            Optional. Called once at load on each quantized weight, already on the device in the
            canonical layout; returns the form this backend's ``linear`` for that method reads
            (its own ``layout``). Register it under the same ``supports`` predicate as that
            ``linear``: the engine selects both per method together. Without it the canonical
            form is what ``linear`` gets.
            """,
            optional=True,
        ),
        _spec(
            "silu_and_mul",
            "silu_and_mul(x: T[N, 2I]) -> T[N, I]",
            "silu(x[:, :I]) * x[:, I:] (the gate is the first half).",
        ),
        _spec(
            "attention",
            "attention(q: T[N, Hq, D], k: T[N, Hk, D], v: T[N, Hk, D], kv_cache: tuple[T, T],"
            " meta: AttentionMetadata, scale: float) -> T[N, Hq, D]",
            """
            First writes k[n], v[n] into kv_cache at slot meta.slot_mapping[n] (in place). Then each
            new token attends causally, softmax(q . K^T * scale) V in float32, over its sequence's
            cached and new tokens, read back through meta.block_tables. GQA: query head h uses
            kv head h // (Hq // Hk). One call covers a mixed batch of prefill chunks and decodes.
            k and v are stored in the cache's dtype (attention reads them back from there); the
            output has q's dtype.
            """,
        ),
        _spec(
            "rotary_attention",
            "rotary_attention(positions: T[N] int64, q: T[N, Hq, D], k: T[N, Hk, D], v: T[N, Hk, D],"
            " cos_sin: T[P, R], style: str, kv_cache: tuple[T, T], meta: AttentionMetadata, scale: float)"
            " -> T[N, Hq, D]",
            """
            Optional (1.19). ``attention(*rotary(positions, q, k, cos_sin, style), v, kv_cache, meta,
            scale)``: the same results, the rotated k rounded to k's dtype before the cache gets
            it, as there. For a backend that rotates q and k in the kernel writing the cache, a
            launch less per layer. The engine calls it in place of the two where the package that
            made it also serves the ``rotary`` and ``attention`` chosen (``FUSED_OPS``); without
            it, or with either of them pinned elsewhere (``--op``), the two run.
            """,
            optional=True,
        ),
        _spec(
            "moe",
            "moe(x: T[N, H], router_weight: T[E, H], gate_up: list[T[2I, H]], down: list[T[H, I]],"
            " top_k: int, scoring: str = 'softmax', renormalize: bool = True,"
            " correction_bias: T[E] | None = None, expert_offset: int = 0) -> T[N, H]",
            """
            Router logits r = x @ router_weight.T (float32). Scores s = softmax(r) or sigmoid(r)
            (``scoring``). Experts chosen by top_k of s + correction_bias (bias only affects the
            choice); weights are the chosen s, divided by their sum when ``renormalize``.
            out[n] = sum_e w[n, e] * down[e] @ silu_and_mul(gate_up[e] @ x[n]).
            Experts tied on s + correction_bias go to the lower expert id.
            Expert parallelism (1.7): ``gate_up`` / ``down`` hold experts ``expert_offset ..
            expert_offset + len(gate_up) - 1`` of the E the router scores; a chosen expert outside
            that range adds nothing (its rank adds it), so a token that chose none gets zeros.
            The core passes ``expert_offset`` only with --enable-expert-parallel.
            A 16-bit implementation may round the activation between the two products to the
            operand dtype, and one on quantized experts may compute in bfloat16 as a quantized
            ``linear`` may (the conformance kit's tolerances say how far).
            """,
        ),
        _spec(
            "pack_experts",
            "pack_experts(gate_up: list[T[2I, H] | QuantizedWeight], down: list[T[H, I] | QuantizedWeight])"
            " -> tuple[Any, Any]",
            """
            Optional (1.8). Called once at load on each sparse layer's routed experts (this
            rank's), already on the device in the canonical form (quantized experts as
            QuantizedWeight); returns the ``(gate_up, down)`` this backend's ``moe`` reads in
            their place, e.g. one stacked ``[E, 2I, H]`` tensor for a grouped GEMM. It is paired
            with ``moe`` by implementation name: only the ``moe`` registered under the same name
            receives what it returns, and without one ``moe`` gets the lists. A ``moe`` with a
            ``pack_experts`` must still take the lists (its pack may keep them, for a layout its
            kernel does not read).
            """,
            optional=True,
        ),
        _spec(
            "sample",
            "sample(logits: T[S, V], batch: SamplingBatch) -> SampleOutput",
            """
            In float32: raw logprobs = log_softmax(logits) (reported); then the logit bias
            (``logits[i, ids] += values``, API 1.11), penalties, suppression, the allowed-token
            bitmask (API 1.10); greedy rows take argmax; others divide by temperature, apply
            top-k, then top-p (smallest set whose probability reaches top_p, always at least one
            token), then min-p (drop tokens below min_p * max prob), renormalise, and draw:
            token = argmax(probs / noise) (ties: lowest id), the Exponential(1) noise being
            counter-based, a function of (seed, step, token id t) computed element-wise with
            32-bit unsigned arithmetic (xor, shifts, multiplication mod 2**32) and one float32
            log1p, so that every implementation (NumPy, torch, Paddle, a GPU kernel) computes
            the same noise wherever it runs (``fd_core.testing.spec.sampling_noise``)::

                fmix32(x)    = murmur3 finalizer: x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13;
                               x *= 0xC2B2AE35; x ^= x >> 16
                lowbias32(x) = x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B;
                               x ^= x >> 16
                lo, hi, st = seed & 0xFFFFFFFF, seed >> 32, step & 0xFFFFFFFF
                key0  = fmix32(fmix32(fmix32(lo ^ 0x243F6A88) ^ hi) ^ st)
                key1  = fmix32(fmix32(fmix32(st ^ 0x85A308D3) ^ lo) ^ hi)
                h     = lowbias32(lowbias32(t ^ key0) ^ key1)
                v     = min(max(float32(h >> 1), 1) * 2**-31, 1 - 2**-24)  # uniform in (0, 1)
                noise = -log1p(-v)                                         # float32

            All integer steps are exact (mod 2**32); ``float32(h >> 1)`` rounds to nearest even
            (exact below 2**24), and the scaling, ``max`` and ``min`` are exact. Only ``log1p``
            may differ in its last ulps between implementations (and exp, sums and divisions
            round differently in kernels), so two conforming implementations can disagree only
            where two tokens' probs / noise are within a few ulps of each other, or where a top-p
            or min-p boundary falls within rounding of a token: near-exact ties.

            Details, chosen as vLLM does where it has a rule: the bias comes before the penalties;
            the bias, penalties and suppression apply to every row, greedy ones included, and
            greedy takes the argmax of the resulting logits (ties: lowest id). Top-k keeps every token at least as likely as the k-th (ties at the
            edge stay). Top-p keeps tokens, most likely first, while the mass before them is below
            top_p, widened to every token tied with the last one kept. Min-p drops tokens strictly
            below min_p * max prob. The noise is float32 before the division. ``ranks``
            counts the tokens whose raw logit is >= the sampled one's, so ties share the worse
            rank (vLLM's count); ``top_ids`` ties go to the lower id.
            """,
        ),
        _spec(
            "sample_async",
            "sample_async(logits: T[S, V], batch: SamplingBatch) -> PendingSample",
            """
            Optional. ``sample`` without waiting for the host: returns at once a PendingSample
            whose ``result()`` is exactly ``sample(logits, batch)`` and whose ``feed`` writes the
            sampled token ids into the next step's input ids on the device. Where a backend has
            it (and ``--async-scheduling`` is not turned off), the engine queues step t+1 before
            it reads step t's tokens, so the host's scheduling and output handling overlap the
            device's work. A backend whose sampler reads the tokens to the host anyway gains
            nothing from it and should leave it out.
            """,
            optional=True,
        ),
        _spec(
            "token_logprobs",
            "token_logprobs(logits: T[Q, V], token_ids: T[Q] int64, num_logprobs: int) -> SampleOutput",
            """
            Optional (1.11). The log-probabilities of given tokens, as ``sample`` reports those of
            the tokens it draws: for each row ``q``, in float32, ``logprobs[q] =
            log_softmax(logits[q])[token_ids[q]]``, ``ranks[q]`` the number of tokens whose logit is
            >= that token's (ties share the worse rank), ``top_ids`` / ``top_logprobs [Q,
            num_logprobs]`` the best logprobs of the row, best first, ties to the lower id, and
            ``token_ids`` the ids given, on the host. No penalty, filter or temperature applies:
            these are the raw model distribution's. The engine calls it for a request's
            ``prompt_logprobs`` (the logits of prompt position ``p`` scoring prompt token
            ``p + 1``), in slices of at most ``max_num_seqs`` rows, after the step's ``sample``;
            without it the engine refuses ``prompt_logprobs``. Every runtime's reference has it.
            """,
            optional=True,
        ),
        _spec(
            "deferred_bitmask",
            "deferred_bitmask(rows: int, words: int) -> DeferredBitmask",
            """
            Optional (1.12). A bitmask the host fills after the sample that applies it is queued:
            given as ``SamplingBatch.allowed_token_bitmask`` to ``sample_async`` (never to
            ``sample``), which queues the mask's use behind a wait on the device for ``ready()``
            and returns without waiting for it. The engine then computes a step's grammar masks
            on a thread of its own while its thread schedules and queues the next step. Work a
            backend queues behind the wait may hold the queuing thread until ``ready()`` (e.g.
            CUDA loading a kernel for the first time synchronises the device), so the engine
            never calls ``ready()`` from the thread that queues. Without it the engine fills the
            mask before the sample is queued.
            """,
            optional=True,
        ),
    ]
}
