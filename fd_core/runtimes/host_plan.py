"""The host side of the reference ops, shared by every runtime: pure NumPy, no tensors.

What a reference op works out on the host before its tensor math is the same whatever the
tensors are: the per-step attention plan (which cache rows each group of queries reads, under
what mask, and in what order the outputs come back), MoE's grouping of (token, slot) pairs by
expert, and ``sample``'s flat token ids, per-row noise (the contract's counter-based noise,
defined in ``fd_core.testing.spec``) and tie rule. It lives here once; a runtime
(``fd_core.runtimes.paddle``, ``fd_core.runtimes.torch``) uploads the arrays to its device, in
the layout its kernels like best, and runs the math. Nothing here imports a tensor
library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from fd_core.interfaces.ops import AttentionMetadata, SamplingBatch
from fd_core.testing import spec

A = TypeVar("A")  # what the plan's arrays are: np.ndarray on the host, a runtime's tensor after
B = TypeVar("B")

# --- attention ---------------------------------------------------------------------------------
#
# The step's single-token queries ("decodes") go in a few batched groups, bucketed by cache
# length; prefill queries go in chunks, each over only the keys it can see. The cache is read by
# gathering rows of a ``[slots * Hk, D]`` view in (kv head, token) order, so every matmul operand
# comes out contiguous, whatever the block tables.

# Prefill queries go in chunks of this many tokens, each over only the keys it can see: that
# skips most of the masked upper triangle and keeps the temporaries small.
PREFILL_CHUNK = 64

# A bucket of decodes costs about as much fixed work as this many padded cache tokens.
DECODE_BUCKET_COST = 1024


@dataclass
class Decodes(Generic[A]):
    """Single-token queries computed together, their caches padded to the longest."""

    count: int
    length: int
    queries: A | None  # [Sd] query rows; None when they are all rows, in order
    rows: A  # [Sd * Hk * length] rows of the cache view; padding reads row 0
    bias: A | None  # on the host [Sd, length], 0 / -inf; None when nothing is padded


@dataclass
class Chunk(Generic[A]):
    """Prefill query rows ``start:end`` of one sequence and the T' tokens they can see."""

    start: int
    end: int
    rows: A  # [Hk * T'] rows of the [slots * Hk, D] cache view
    bias: A  # on the host [L', T'], the additive causal mask, 0 or -inf


@dataclass
class AttentionPlan(Generic[A]):
    """One step's attention work, shared by every layer: host arrays from ``plan_attention``,
    a runtime's tensors after ``upload``."""

    slot_mapping: A  # int64 [N]
    decodes: list[Decodes[A]]
    chunks: list[Chunk[A]]
    order: A | None  # rows of concat(decodes, chunks) in token order; None if identity

    @property
    def empty(self) -> bool:
        """No sequence of the step has a new token: there is nothing to attend."""
        return not self.decodes and not self.chunks

    def upload(
        self,
        upload: Callable[[np.ndarray], B],
        decode_bias: Callable[[np.ndarray], np.ndarray],
        chunk_bias: Callable[[np.ndarray], np.ndarray],
    ) -> AttentionPlan[B]:
        """The plan with every array passed through ``upload``; the masks first reshaped by
        ``decode_bias`` (from ``[Sd, T]``) and ``chunk_bias`` (from ``[L', T']``) into the
        layout the runtime's kernels broadcast them in."""

        def maybe(array: np.ndarray | None) -> B | None:
            return None if array is None else upload(array)

        return AttentionPlan(
            slot_mapping=upload(self.slot_mapping),
            decodes=[
                Decodes(
                    d.count,
                    d.length,
                    maybe(d.queries),
                    upload(d.rows),
                    None if d.bias is None else upload(decode_bias(d.bias)),
                )
                for d in self.decodes
            ],
            chunks=[
                Chunk(c.start, c.end, upload(c.rows), upload(chunk_bias(c.bias)))
                for c in self.chunks
            ],
            order=maybe(self.order),
        )


def length_buckets(lengths: np.ndarray) -> list[slice]:
    """Cut ascending ``lengths`` into buckets minimising padded tokens plus a per-bucket cost.

    One bucket pads every decode to the longest; mixed lengths waste up to half the reads.
    """
    n = len(lengths)
    best = np.zeros(n + 1)
    start = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # The last bucket is i..j-1, padded to lengths[j - 1].
        cost = best[:j] + (j - np.arange(j)) * lengths[j - 1] + DECODE_BUCKET_COST
        start[j] = int(np.argmin(cost))
        best[j] = cost[start[j]]
    cuts, j = [], n
    while j > 0:
        cuts.append(slice(int(start[j]), j))
        j = int(start[j])
    return cuts[::-1]


def cache_rows(meta: AttentionMetadata, seq: int, length: int, num_kv_heads: int) -> np.ndarray:
    """``[Hk, length]`` rows of the cache view holding the first ``length`` tokens of ``seq``."""
    pos = np.arange(length)
    bs = meta.block_size
    slots = meta.block_tables[seq][pos // bs] * bs + pos % bs
    return slots[None, :] * num_kv_heads + np.arange(num_kv_heads)[:, None]


def _decodes(meta: AttentionMetadata, seqs: np.ndarray, num_kv_heads: int) -> Decodes[np.ndarray]:
    lens = meta.seq_lens[seqs]
    length = int(lens.max())
    rows = np.zeros((len(seqs), num_kv_heads, length), dtype=np.int64)
    for j, seq in enumerate(seqs):
        rows[j, :, : lens[j]] = cache_rows(meta, seq, int(lens[j]), num_kv_heads)
    bias = None
    if np.any(lens != length):
        pad = np.arange(length)[None, :] >= lens[:, None]
        bias = np.where(pad, -np.inf, 0.0).astype(np.float32)
    queries = meta.query_start_loc[seqs]
    in_order = np.array_equal(queries, np.arange(int(meta.query_start_loc[-1])))
    return Decodes(
        count=len(seqs),
        length=length,
        queries=None if in_order else queries,
        rows=rows.reshape(-1),
        bias=bias,
    )


def _chunks(meta: AttentionMetadata, seq: int, num_kv_heads: int) -> list[Chunk[np.ndarray]]:
    qsl = meta.query_start_loc
    context = int(meta.context_lens[seq])
    chunks = []
    for start in range(int(qsl[seq]), int(qsl[seq + 1]), PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, int(qsl[seq + 1]))
        query_pos = context + np.arange(start - qsl[seq], end - qsl[seq])
        visible = int(query_pos[-1]) + 1
        hidden = np.arange(visible)[None, :] > query_pos[:, None]
        bias = np.where(hidden, -np.inf, 0.0).astype(np.float32)
        rows = cache_rows(meta, seq, visible, num_kv_heads).reshape(-1)
        chunks.append(Chunk(start, end, rows, bias))
    return chunks


def plan_attention(meta: AttentionMetadata, num_kv_heads: int) -> AttentionPlan[np.ndarray]:
    """The step's attention work on the host. Sequences without new tokens take no part."""
    qsl = meta.query_start_loc
    query_lens = np.diff(qsl)
    num_rows = int(qsl[-1])

    decodes = np.flatnonzero(query_lens == 1)
    decodes = decodes[np.argsort(meta.seq_lens[decodes], kind="stable")]
    buckets = length_buckets(meta.seq_lens[decodes]) if len(decodes) else []
    decode_groups = [_decodes(meta, decodes[b], num_kv_heads) for b in buckets]

    prefills = np.flatnonzero(query_lens > 1)
    chunks = [c for seq in prefills for c in _chunks(meta, int(seq), num_kv_heads)]

    # Outputs are computed decodes first, then prefills in order; `order` puts rows back.
    produced = np.concatenate(
        [qsl[decodes]] + [np.arange(qsl[s], qsl[s + 1]) for s in prefills]
    ).astype(np.int64)
    order = None
    if not np.array_equal(produced, np.arange(num_rows)):
        order = np.empty(num_rows, dtype=np.int64)
        order[produced] = np.arange(num_rows)

    return AttentionPlan(
        slot_mapping=meta.slot_mapping.astype(np.int64),
        decodes=decode_groups,
        chunks=chunks,
        order=order,
    )


def device_plan(
    meta: AttentionMetadata,
    key: str,
    num_kv_heads: int,
    upload: Callable[[np.ndarray], B],
    decode_bias: Callable[[np.ndarray], np.ndarray],
    chunk_bias: Callable[[np.ndarray], np.ndarray],
) -> AttentionPlan[B]:
    """``plan_attention`` uploaded (see ``AttentionPlan.upload``), built by the first layer of a
    step and kept in ``meta.device`` under ``key`` for the others."""
    plan = meta.device.get(key)
    if plan is None:
        host = plan_attention(meta, num_kv_heads)
        plan = meta.device[key] = host.upload(upload, decode_bias, chunk_bias)
    return plan


# --- moe ---------------------------------------------------------------------------------------


def expert_groups(ids: np.ndarray, first: int = 0, count: int | None = None) -> list[tuple[int, np.ndarray]]:
    """The router's choices grouped by expert, so that each expert runs one matmul.

    ``ids`` is the ``[N, top_k]`` expert id of every (token, slot) pair; returns ``(expert -
    first, pairs)`` for each chosen expert in ``first .. first + count - 1`` (all of them when
    ``count`` is None), ascending, ``pairs`` indexing the flattened ``ids`` in order (its token
    is ``pairs // top_k``). Under expert parallelism the other experts are other ranks'.
    """
    flat = ids.reshape(-1)
    by_expert = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[by_expert], return_index=True)
    bounds = list(starts) + [len(flat)]
    return [(int(e) - first, by_expert[bounds[j] : bounds[j + 1]]) for j, e in enumerate(experts)
            if first <= e and (count is None or e < first + count)]


# --- sample ------------------------------------------------------------------------------------


def flat_ids(per_row: list[np.ndarray], vocab: int) -> np.ndarray:
    """``row * V + id`` of every token id of every row, for scattering into a flat ``[S * V]``."""
    parts = [np.zeros(0, dtype=np.int64)]
    for i, ids in enumerate(per_row):
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        # An id out of range would land silently in a neighbouring row.
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"row {i} has a token id outside the vocabulary of {vocab}")
        parts.append(ids + i * vocab)
    return np.concatenate(parts)


@dataclass
class Penalties:
    """Where ``apply_penalties`` scatters into a flat ``[S * V]``, and what (see ``flat_ids``)."""

    seen: np.ndarray  # flat ids of every token of a row's prompt or output, unique
    factors: np.ndarray  # float32, the repetition penalty of each ``seen`` id's row
    output: np.ndarray  # flat ids of every token of a row's output, unique
    counts: np.ndarray  # float32, how often each ``output`` id occurs in its row's output


def penalties(batch: SamplingBatch, vocab: int) -> Penalties:
    output, counts = np.unique(flat_ids(batch.output_token_ids, vocab), return_counts=True)
    seen = np.union1d(output, flat_ids(batch.prompt_token_ids, vocab))
    return Penalties(
        seen=seen,
        factors=batch.repetition_penalty[seen // vocab].astype(np.float32),
        output=output,
        counts=counts.astype(np.float32),
    )


def biases(batch: SamplingBatch, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids (``flat_ids``) of every biased token and their float32 biases; empty where
    ``batch.logit_bias`` is None. A row's ids are distinct, so no two entries share a flat id."""
    rows = batch.logit_bias or []
    values = [np.zeros(0, dtype=np.float32)] + [np.asarray(v, dtype=np.float32).reshape(-1) for _, v in rows]
    return flat_ids([ids for ids, _ in rows], vocab), np.concatenate(values)


def suppressed(batch: SamplingBatch, vocab: int) -> np.ndarray:
    """Flat ids of every suppressed token, unique."""
    return np.unique(flat_ids(batch.suppress_token_ids, vocab))


def noise_keys(batch: SamplingBatch, rows: np.ndarray) -> np.ndarray:
    """The ``rows``' two noise key words (``spec.sampling_keys``) as int64 ``[len(rows), 2]``, for
    a runtime or kernel that computes the per-token part of the noise on its device."""
    key0, key1 = spec.sampling_keys(batch.seeds[rows], batch.steps[rows])
    return np.stack([key0, key1], axis=1).astype(np.int64)


def noise(batch: SamplingBatch, rows: np.ndarray, vocab: int) -> np.ndarray:
    """The ``rows``' float32 Exponential(1) noise ``[len(rows), vocab]``: the contract's
    counter-based noise (``fd_core.testing.spec.sampling_noise``), a function of each row's seed,
    step and token id alone, which is what makes a seeded row reproducible across runtimes and
    batches."""
    return spec.sampling_noise(batch.seeds[rows], batch.steps[rows], vocab)


def top_k_ties_unresolved(values: np.ndarray, at_least_last: np.ndarray) -> bool:
    """Whether a ``topk`` answer may break the contract's rule that ties go to the lower id.

    ``values`` are its ``[S, k]`` values, best first, and ``at_least_last`` counts each row's
    tokens at least its last value. A runtime's topk orders ties as it likes, so its answer is
    right unless a tie touches it: two equal values inside it, or an equal value left outside
    it. Then only a stable sort gives the contract's order.
    """
    inside = bool((values[:, 1:] == values[:, :-1]).any())
    outside = bool((np.asarray(at_least_last).reshape(-1) > values.shape[1]).any())
    return inside or outside


def block_rows(src_to_dst, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The cache rows of whole-block copies ``(src, dst)``: source rows and destination rows,
    block after block (a block is ``block_size`` consecutive rows)."""
    pairs = np.asarray(src_to_dst, dtype=np.int64).reshape(-1, 2)
    offsets = np.arange(block_size, dtype=np.int64)
    return (pairs[:, :1] * block_size + offsets).reshape(-1), (pairs[:, 1:] * block_size + offsets).reshape(-1)
