"""The one model runner every backend shares.

It turns a scheduled step into host arrays (token ids, positions, attention metadata, sampling
parameters), moves them to the device through the backend's Memory, runs the model through the
op table, and samples. Nothing here knows which chip or tensor library it drives; a backend
adds chip-specific steps through ``ModelRunnerHooks`` (e.g. replaying captured graphs).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fd_core.engine import bad_words
from fd_core.engine.block_rows import BlockTableRows
from fd_core.engine.sampling_params import SamplingParams
from fd_core.engine.scheduler import ScheduledSeq
from fd_core.engine.sequence import PLACEHOLDER, Sequence
from fd_core.quantization.kv_cache import cache_layout
from fd_core.interfaces import (
    AttentionMetadata,
    Memory,
    ModelRunnerHooks,
    PendingSample,
    RunnerLimits,
    SampleOutput,
    SamplingBatch,
)

_EMPTY = np.zeros(0, dtype=np.int64)
_NO_BIAS = (_EMPTY, np.zeros(0, dtype=np.float32))  # a row without logit_bias beside one with


# (sequence, first, end): the step scored the sequence's prompt tokens first..end-1, in order
Scored = list[tuple[Sequence, int, int]]


@dataclass
class StepResult:
    """Sampled tokens, one row per sequence in ``sampled``: the scheduled sequences whose step
    reached their end, each followed by the forks seated with it (they sample from the same
    logits, each with its own seed). ``prompt``: the prompt tokens the step scored
    (prompt_logprobs), one row per token of ``scored``."""

    sampled: list[Sequence]
    output: SampleOutput | None
    scored: Scored = field(default_factory=list)
    prompt: SampleOutput | None = None


@dataclass
class Launched:
    """A step queued on the device whose tokens the host has not read: ``pending.result()``
    has one row per sequence in ``sampled``; ``rows`` maps a sequence id to its row."""

    sampled: list[Sequence]
    pending: PendingSample | None
    rows: dict[int, int]
    scored: Scored = field(default_factory=list)  # as StepResult's: already on the host
    prompt: SampleOutput | None = None


@dataclass
class Feed:
    """Input ids of a step that come from the previous step's sample, still on the device:
    ``ids[dest[j]] = tokens' token_ids[src[j]]`` (a decode row whose last token is not on the
    host yet)."""

    tokens: PendingSample
    dest: np.ndarray  # [K] int64, positions in the step's input ids
    src: np.ndarray  # [K] int64, rows of the previous step's sample


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward: host arrays only, so that rank 0 can
    send them to the others of a tensor-parallel model."""

    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    meta: AttentionMetadata
    logit_rows: np.ndarray  # [R] int64: the hidden rows whose logits are sampled
    # prompt_logprobs: the hidden rows whose logits score a prompt token, and that token
    prompt_rows: np.ndarray = field(default_factory=_EMPTY.copy)  # [Q] int64
    prompt_token_ids: np.ndarray = field(default_factory=_EMPTY.copy)  # [Q] int64
    num_prompt_logprobs: int = 0  # the most top logprobs a scored sequence asks for

    def score_prompts(self, scheduled: list[ScheduledSeq]) -> Scored:
        """Add the rows that score the prompt tokens the ``scheduled`` sequences still owe
        (``Sequence.prompt_scored``); returns which tokens of which sequence they score. The
        logits of position p score prompt token p + 1, so a prompt's chunks (each with its
        last position) score every token after the first; a position computed again after a
        preemption by recompute scores nothing the sequence has already."""
        rows, ids, scored, most = [], [], [], 0
        starts = self.meta.query_start_loc
        for i, s in enumerate(scheduled):
            seq = s.seq
            if not seq.owes_prompt_logprobs:
                continue
            computed = seq.num_computed
            first = max(computed + 1, seq.prompt_scored)
            end = min(computed + s.num_new + 1, len(seq.prompt_token_ids))
            if first >= end:
                continue
            offset = int(starts[i]) - computed - 1  # the row of the position before token t: t + offset
            rows.append(np.arange(first + offset, end + offset, dtype=np.int64))
            ids += seq.prompt_token_ids[first:end]
            scored.append((seq, first, end))
            most = max(most, seq.params.prompt_logprobs)
        if scored:
            self.prompt_rows = np.concatenate(rows)
            self.prompt_token_ids = np.asarray(ids, dtype=np.int64)
            self.num_prompt_logprobs = most
        return scored


@dataclass
class ProposalPlan:
    """What every rank needs to run the speculative proposer's own model (a draft model, an MTP
    layer) after a step: its catch-up over the tokens it has not computed yet (``inputs``, whose
    logit rows are each drafting sequence's last token there), which gives each drafting
    sequence its first draft; then passes of one token per sequence still drafting, each the
    draft before at the position after, until sequence ``i`` has ``num_drafts[i]``."""

    inputs: StepInputs
    num_drafts: np.ndarray  # [S] int64, at least 1
    block_tables: np.ndarray  # [S, W] int64, the drafting sequences'
    last_positions: np.ndarray  # [S] int64, the position of each one's last catch-up token
    # MTP: per catch-up token, its row of the hidden states of the target step just run
    hidden_rows: np.ndarray | None = None


def greedy_batch(rows: int) -> SamplingBatch:
    """Sampling parameters that draw each row's most likely token (a proposer's draft)."""
    empty = [_EMPTY] * rows
    return SamplingBatch(
        temperature=np.zeros(rows, np.float32), top_p=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int64),
        min_p=np.zeros(rows, np.float32), presence_penalty=np.zeros(rows, np.float32),
        frequency_penalty=np.zeros(rows, np.float32), repetition_penalty=np.ones(rows, np.float32),
        seeds=np.zeros(rows, np.int64), steps=np.zeros(rows, np.int64), prompt_token_ids=empty,
        output_token_ids=empty, suppress_token_ids=empty)


def prepare_inputs(scheduled: list[ScheduledSeq], block_size: int,
                   kept: BlockTableRows | None = None) -> tuple[StepInputs, list[Sequence]]:
    """The step's inputs, and the sequences that sample, one per logit row in that order: each
    scheduled sequence whose step reaches its end, followed by the forks the scheduler seated
    with it (``ScheduledSeq.forks``: they sample from the same row, each with its own seed). A
    sequence verifying drafts (``ScheduledSeq.drafts``) computes them after its last token and
    samples a row at each of those positions: it appears once per row.

    Built with one Python pass over the sequences and array operations after it: at a few
    hundred sequences per step this runs every step, between two forwards. ``kept``: the
    engine's block tables kept from step to step (else built from the lists)."""
    num_seqs = len(scheduled)
    query_lens = np.fromiter((s.num_new for s in scheduled), dtype=np.int64, count=num_seqs)
    context_lens = np.fromiter((s.seq.num_computed for s in scheduled), dtype=np.int64, count=num_seqs)
    num_tokens = int(query_lens.sum())
    if num_tokens == num_seqs:  # one token each (decodes, mostly)
        ids = np.fromiter((s.seq.token_at(s.seq.num_computed) for s in scheduled), dtype=np.int64, count=num_seqs)
    else:
        ids = np.fromiter(itertools.chain.from_iterable(
            s.seq.tokens_between(s.seq.num_computed, s.seq.num_computed + s.num_new - len(s.drafts)) + s.drafts
            for s in scheduled), dtype=np.int64, count=num_tokens)
    tables = kept.tables([s.seq for s in scheduled]) if kept is not None else [s.seq.block_table for s in scheduled]
    inputs = ragged_inputs(ids, tables, context_lens, query_lens, block_size)
    query_start_loc = inputs.meta.query_start_loc
    sampled: list[Sequence] = []
    rows: list[int] = []
    for i, s in enumerate(scheduled):
        if s.samples:
            row = int(query_start_loc[i + 1]) - 1
            if s.drafts:  # a row after its last token and after each draft
                k = len(s.drafts)
                sampled += [s.seq] * (k + 1)
                rows += range(row - k, row + 1)
                continue
            sampled.append(s.seq)
            rows.append(row)
            for fork in s.forks:
                sampled.append(fork)
                rows.append(row)
    inputs.logit_rows = np.asarray(rows, dtype=np.int64)
    return inputs, sampled


def ragged_inputs(ids: np.ndarray, tables: list[list[int]] | np.ndarray, context_lens: np.ndarray,
                  query_lens: np.ndarray, block_size: int) -> StepInputs:
    """A step of ``ids`` (int64) over sequences with block tables ``tables``, each computing
    ``query_lens[i]`` tokens after its first ``context_lens[i]``: positions, slot mapping and
    attention metadata; no logit rows yet."""
    num_seqs = len(query_lens)
    decode = len(ids) == num_seqs and not (query_lens != 1).any()  # one token a sequence
    if decode:
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int64)
    else:
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    if isinstance(tables, np.ndarray):
        block_tables = tables
    else:
        widths = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)
        block_tables = np.zeros((num_seqs, int(widths.max())), dtype=np.int64)
        # row-major boolean assignment fills each row's first `width` entries in order
        block_tables[np.arange(block_tables.shape[1]) < widths[:, None]] = np.fromiter(
            itertools.chain.from_iterable(tables), dtype=np.int64, count=int(widths.sum()))
    # a decode step (most steps) skips the token-to-sequence expansion: a few NumPy calls less
    # on the path between two forwards (6.8 -> 5.1 us at one sequence, 2-core EPYC host)
    seq_of_token = query_start_loc[:-1] if decode else np.repeat(np.arange(num_seqs), query_lens)
    positions = context_lens.copy() if decode else (
        context_lens[seq_of_token] + (np.arange(num_tokens) - query_start_loc[seq_of_token]))
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=context_lens + query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping,
        block_size=block_size,
    )
    return StepInputs(ids, positions, meta, _EMPTY)


def prefill_batch(prompts: list[list[int]], block_size: int,
                  params: SamplingParams | None = None) -> list[ScheduledSeq]:
    """A step that prefills each prompt whole, from blocks 1, 2, ... laid out one prompt after
    another (block 0 is never handed out) — for running the model outside the engine's
    scheduler: profiling, and tests that read a prompt's logits."""
    scheduled, first = [], 1
    for i, prompt in enumerate(prompts):
        count = -(-len(prompt) // block_size)
        seq = Sequence(seq_id=i, request_id=f"prefill-{i}", index=0, prompt_token_ids=list(prompt),
                       params=params or SamplingParams(), seed=0, arrival=i,
                       block_table=list(range(first, first + count)))
        scheduled.append(ScheduledSeq(seq, len(prompt)))
        first += count
    return scheduled


class ModelRunner:
    """One rank's model, KV cache and swap space."""

    def __init__(self, model: Any, ops: Any, memory: Memory, block_size: int,
                 hooks: ModelRunnerHooks | None = None, limits: RunnerLimits | None = None,
                 enforce_eager: bool = False, proposer: Any = None) -> None:
        self.model = model
        self.ops = ops
        self.memory = memory
        self.block_size = block_size
        # the speculative proposer's own model (a draft model, an MTP layer), if any: its KV
        # cache layers follow the model's, in the same blocks
        self.proposer = proposer
        self._target_hidden: Any = None  # the last step's hidden states, where the proposer reads them
        self.kv_caches: list[tuple[Any, Any]] = []
        self.proposer_caches: list[tuple[Any, Any]] = []
        self.host_caches: list[tuple[Any, Any]] = []  # swap space
        self._staging: list[tuple[Any, Any]] = []  # host blocks export_kv copies through
        self._staging_blocks = 0
        self.forward = model.forward
        self._with_head = False  # self.forward.with_head runs a decode step's forward and head
        self._with_sample = False  # self.forward.with_sample samples it too (API 1.20)
        self._advances = False  # self.forward.advance_sample runs the decode step after a draw (API 1.21)
        self._drew = False  # the last launch's forward drew its tokens (with_sample, advance_sample)
        self.score_rows = limits.max_num_seqs if limits is not None else 256  # see _score_prompts
        wrap = getattr(hooks, "wrap_forward", None) if hooks is not None else None
        # a draft model's forward has the target's signature, so the hook may replace it too
        # (an MTP layer's reads the target's hidden states besides, and runs as it is)
        self.proposer_forward = proposer.forward if proposer is not None else None
        if wrap is not None and not enforce_eager:
            # a hook written for API 1.0/1.1 takes the forward alone
            takes_limits = len(inspect.signature(wrap).parameters) >= 2
            self.forward = wrap(model.forward, limits) if takes_limits else wrap(model.forward)
            if proposer is not None and not getattr(proposer, "reads_target_hidden", False):
                self.proposer_forward = wrap(proposer.forward, limits) if takes_limits else wrap(proposer.forward)
            # a replacement that can run the head with the forward (API 1.18: a graph holding
            # both) gets it; not under tensor parallelism, whose head gathers across ranks
            attach = getattr(self.forward, "attach_head", None)
            if attach is not None and not getattr(getattr(model, "tp", None), "enabled", False):
                attach(model.compute_logits)
                self._with_head = True
                # and one that can draw the step's tokens in it with the op table's sampler (1.20)
                attach_sampler = getattr(self.forward, "attach_sampler", None)
                if attach_sampler is not None and ops.has("sample_async"):
                    self._with_sample = bool(attach_sampler(ops.sample_async))
                    self._advances = self._with_sample and callable(getattr(self.forward, "advance_sample", None))

    def _allocate(self, allocate: Any, num_blocks: int, dtype: str, model: Any = None) -> list[tuple[Any, Any]]:
        m = model or self.model  # its own heads: a tensor-parallel rank holds a slice
        return allocate(m.config.num_hidden_layers, num_blocks, self.block_size, m.num_kv_heads, m.head_dim, dtype)

    @property
    def _all_caches(self) -> list[tuple[Any, Any]]:
        return self.kv_caches + self.proposer_caches

    def memory_info(self) -> tuple[int, int]:
        return self.memory.memory_info()

    def pads_drafts(self) -> bool:
        """Whether the forward runs verification steps fastest with every sequence verifying the
        same number of drafts (a hook's ``uniform_drafts``: captured graphs of that shape)."""
        return bool(getattr(self.forward, "uniform_drafts", False))

    def sample_lacks(self, since: str) -> str:
        """Why this rank's sample ops cannot do what contract ``since`` added to them ("" if
        they can): structured output's bitmask (1.10), logit_bias (1.11)."""
        return self.ops.lacks("sample", since) or self.ops.lacks("sample_async", since)

    def scores_lack(self) -> str:
        """Why this rank cannot score prompt tokens (prompt_logprobs; "" if it can)."""
        return "" if self.ops.has("token_logprobs") else "its op table has no token_logprobs op"

    def initialize_kv_cache(self, num_blocks: int, dtype: str = "float32") -> None:
        self._cache_dtype = dtype
        self.kv_caches = self._allocate(self.memory.allocate_kv_cache, num_blocks, dtype)
        if self.proposer is not None:
            self.proposer_caches = self._allocate(self.memory.allocate_kv_cache, num_blocks, dtype, self.proposer)
        for forward, caches in ((self.forward, self.kv_caches), (self.proposer_forward, self.proposer_caches)):
            warm_up = getattr(forward, "warm_up", None)
            if warm_up is not None:  # e.g. capture graphs before the first request
                warm_up(caches, self.memory.device)

    def initialize_swap_space(self, num_blocks: int, dtype: str = "float32") -> None:
        self.host_caches = self._allocate(self.memory.allocate_host_kv_cache, num_blocks, dtype)
        if self.proposer is not None:
            self.host_caches += self._allocate(self.memory.allocate_host_kv_cache, num_blocks, dtype, self.proposer)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.swap_blocks(self._all_caches, self.host_caches, self.block_size, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.swap_blocks(self.host_caches, self._all_caches, self.block_size, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.copy_blocks(self._all_caches, self.block_size, pairs)

    def export_kv(self, block_ids: list[int], on_device: bool = False) -> list[Any]:
        """``block_ids``' keys and values as host arrays, a key and a value per layer, each
        ``[len(block_ids) * block_size, heads, row]`` in the cache's storage dtype, bfloat16 as
        its bits (uint16: NumPy has no bfloat16, and widening to float32 doubled the bytes sent).
        Staged through a host cache with the Memory's ``swap_blocks``, the copy preemption by
        swap uses. ``on_device``: the same as the Memory's tensors, a copy on the device (for a
        connector that moves device memory), which the caller may keep after the blocks are freed."""
        if not block_ids:
            return []
        n = len(block_ids)
        if on_device:
            copy = self._allocate(self.memory.allocate_kv_cache, n, self._cache_dtype)
            self.memory.swap_blocks(self.kv_caches, copy, self.block_size, list(zip(block_ids, range(n))))
            return [t for pair in copy for t in pair]
        if n > self._staging_blocks:
            # kept for the next requests: page-locked host memory is slow to allocate (an H100 host
            # took about as long to pin a request's 37 MiB as to copy them)
            self._staging_blocks = max(n, 2 * self._staging_blocks)
            self._staging = self._allocate(self.memory.allocate_host_kv_cache, self._staging_blocks, self._cache_dtype)
        self.memory.swap_blocks(self.kv_caches, self._staging, self.block_size, list(zip(block_ids, range(n))))
        rows = n * self.block_size
        storage = cache_layout(self._cache_dtype, self.model.head_dim)[1]
        return [_to_wire(self.memory, t[:rows], storage) for pair in self._staging for t in pair]

    def import_kv(self, block_ids: list[int], first: int, arrays: list[np.ndarray]) -> None:
        """Write blocks ``first, first + 1, ...`` of ``export_kv``'s ``arrays`` (from another
        engine of the same model, cache dtype and block size) into ``block_ids``."""
        if not block_ids:
            return
        layers = len(self.kv_caches)
        if len(arrays) != 2 * layers:
            raise ValueError(f"transferred keys and values of {len(arrays) // 2} layers for a model of {layers}")
        bs, n = self.block_size, len(block_ids)
        rows = slice(first * bs, (first + n) * bs)
        storage = cache_layout(self._cache_dtype, self.model.head_dim)[1]  # what export_kv sent
        staged = [(_from_wire(self.memory, arrays[2 * i][rows], storage),
                   _from_wire(self.memory, arrays[2 * i + 1][rows], storage)) for i in range(layers)]
        want = tuple(self.kv_caches[0][0].shape[1:])
        if tuple(staged[0][0].shape[1:]) != want or staged[0][0].shape[0] != n * bs:
            raise ValueError(f"transferred blocks of shape {tuple(staged[0][0].shape)} for {n} blocks of "
                             f"{bs} x {want}")
        self.memory.swap_blocks(staged, self.kv_caches, bs, list(zip(range(n), block_ids)))

    def profile_memory(self, num_tokens: int, num_rows: int, max_model_len: int, dtype: str) -> tuple[int, int, int]:
        """Run the largest step the engine may schedule — ``num_tokens`` prompt tokens in
        sequences of at most ``max_model_len``, then logits and top-k/top-p sampling for
        ``num_rows`` rows — on a throw-away KV cache; return ``(free, total, peak)``: the
        device's memory afterwards and the most the step held at once (the cache included,
        which errs on the safe side)."""
        lengths = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05)
        scheduled = prefill_batch([[0] * n for n in lengths], self.block_size, params)
        inputs, sampled = prepare_inputs(scheduled, self.block_size)
        # every row a step may sample at most, each the last token's
        inputs.logit_rows = np.full(num_rows, num_tokens - 1, dtype=np.int64)
        batch = sampling_batch([sampled[-1]] * num_rows, _EMPTY)
        num_blocks = 1 + sum(len(s.seq.block_table) for s in scheduled)
        kept = self.kv_caches

        def step() -> None:
            self.kv_caches = self._allocate(self.memory.allocate_kv_cache, num_blocks, dtype)
            try:
                self.ops.sample(self.run(inputs, eager=True), batch)
            finally:
                self.kv_caches = kept

        peak = self.memory.profile(step)
        free, total = self.memory.memory_info()
        return free, total, peak

    def _forward(self, inputs: StepInputs, eager: bool, feed: Feed | None,
                 batch: SamplingBatch | None = None) -> tuple[Any, Any, Any, Any]:
        """The step's hidden states, its int64 inputs on the device (input ids, positions,
        logit rows, then the prompt rows and the tokens they score, then the feed's), the
        logits where the forward's replacement computed them with it (else None), and its
        draw of ``batch``'s rows (a PendingSample) where it sampled them too (else None)."""
        self._drew = False
        n, rows, scored = len(inputs.input_ids), len(inputs.logit_rows), len(inputs.prompt_rows)
        parts = [inputs.input_ids, inputs.positions, inputs.logit_rows]
        if scored:
            parts += [inputs.prompt_rows, inputs.prompt_token_ids]
        if feed is not None:
            parts += [feed.dest, feed.src]
        # one upload for all the int64 arrays (a host-to-device copy costs ~10-30 us on a GPU)
        packed = self.memory.from_numpy(np.concatenate(parts))
        ids = packed[:n]
        if feed is not None:
            k, at = len(feed.dest), 2 * n + rows + 2 * scored
            ids = feed.tokens.feed(ids, packed[at : at + k], packed[at + k :])
        if self._with_head and not eager and _every_row_samples(inputs):
            if self._with_sample and batch is not None:
                got = self.forward.with_sample(ids, packed[n : 2 * n], self.kv_caches, inputs.meta, batch)
                if got is not None:
                    self._drew = got[2] is not None
                    return got[0], packed, got[1], got[2]
            both = self.forward.with_head(ids, packed[n : 2 * n], self.kv_caches, inputs.meta)
            if both is not None:
                return both[0], packed, both[1], None
        forward = self.model.forward if eager else self.forward
        return forward(ids, packed[n : 2 * n], self.kv_caches, inputs.meta), packed, None, None

    def _logits(self, inputs: StepInputs, hidden: Any, packed: Any, logits: Any = None) -> Any:
        """The logits of the step's sampling rows (``logits``: the forward's own, if it made
        them), None if it has none."""
        n, rows = len(inputs.input_ids), len(inputs.logit_rows)
        if not rows:
            return None
        if logits is not None:
            return logits
        if _every_row_samples(inputs):  # decodes: no gather
            return self.model.compute_logits(hidden, None)
        return self.model.compute_logits(hidden, packed[2 * n : 2 * n + rows])

    def _score_prompts(self, inputs: StepInputs, hidden: Any, packed: Any, lead: bool) -> SampleOutput | None:
        """The prompt tokens of ``inputs.prompt_rows`` scored (``token_logprobs``), by rank 0
        (``lead``); the other ranks only take part in the logits' collectives. In slices of
        at most max_num_seqs rows: a prompt chunk's logits would otherwise be [tokens, V], far
        more than the most a step samples, which is what profiling sized the KV cache beside."""
        scored = len(inputs.prompt_rows)
        if not scored:
            return None
        at = 2 * len(inputs.input_ids) + len(inputs.logit_rows)
        rows, ids = packed[at : at + scored], packed[at + scored : at + 2 * scored]
        parts = []
        for start in range(0, scored, self.score_rows):
            end = min(start + self.score_rows, scored)
            logits = self.model.compute_logits(hidden, rows[start:end])
            if lead:
                parts.append(self.ops.token_logprobs(logits, ids[start:end], inputs.num_prompt_logprobs))
        return join_outputs(parts) if lead else None

    def run(self, inputs: StepInputs, eager: bool = False, feed: Feed | None = None) -> Any:
        """Forward over the step and the logits of its sampling rows (None if there are none).
        Every rank of a tensor-parallel model runs this with the same inputs. ``eager``: the
        model's own forward, not a hook's replacement. ``feed``: input ids still on the device
        (``Feed``), written over the placeholders of ``inputs.input_ids``."""
        hidden, packed, logits, _ = self._forward(inputs, eager, feed)
        return self._logits(inputs, hidden, packed, logits)

    def step(self, inputs: StepInputs, batch: SamplingBatch | None,
             before_sample: Callable[[SamplingBatch], None] | None = None,
             lead: bool = True) -> tuple[SampleOutput | None, SampleOutput | None]:
        """``run``, then sample the logits with ``batch``, then score the prompt rows: the
        step's sample and prompt scores. A tensor-parallel rank other than 0 (not ``lead``,
        given no batch) only takes part in the collectives. ``before_sample`` completes
        ``batch`` once the forward is queued (structured output's bitmask: on a device that
        computes asynchronously, the host fills it while the forward runs)."""
        return self._step(inputs, batch, None, before_sample, self.ops.sample, lead, wait=True)

    def launch(self, inputs: StepInputs, batch: SamplingBatch | None, feed: Feed | None = None,
               before_sample: Callable[[SamplingBatch], None] | None = None, lead: bool = True
               ) -> tuple[PendingSample | None, SampleOutput | None]:
        """``step`` without waiting for the tokens (the op table's ``sample_async``): the
        device may still be computing when this returns, unless the step scores prompt
        tokens (their scores come back to the host, after the sample is queued). Every
        tensor-parallel rank samples (the gathered logits and the batch are the same on each,
        so are the tokens): the next step's input ids come from its own device's sample."""
        return self._step(inputs, batch, feed, before_sample, self.ops.sample_async, lead)

    def advance(self, batch: SamplingBatch) -> PendingSample | None:
        """The decode step that follows the last ``launch``, queued by the forward's replacement
        alone where it can (API 1.21, ``advance_sample``): the same sequences, each one position
        further, its input the token the last step drew, sampled with ``batch`` (the last step's,
        each row's step index one further). None where it cannot, or where the last launch's
        forward did not draw its tokens: the caller builds the step and ``launch``es it."""
        if not (self._advances and self._drew):
            return None
        drawn = self.forward.advance_sample(batch)
        self._drew = drawn is not None
        return drawn

    def can_launch(self) -> bool:
        """Whether this rank's op table has ``sample_async`` (``launch``)."""
        return self.ops.has("sample_async")

    def _step(self, inputs: StepInputs, batch: SamplingBatch | None, feed: Feed | None,
              before_sample: Callable[[SamplingBatch], None] | None, sample: Callable[..., Any],
              lead: bool, wait: bool = False) -> tuple[Any, SampleOutput | None]:
        # a batch completed after the forward is queued (a grammar's bitmask) is sampled by the op
        hidden, packed, logits, drawn = self._forward(inputs, False, feed, batch if before_sample is None else None)
        if getattr(self.proposer, "reads_target_hidden", False):
            self._target_hidden = hidden  # until the proposer has read this step's rows
        if drawn is not None:  # the forward's replacement sampled the rows (with_sample)
            return (drawn.result() if wait else drawn), self._score_prompts(inputs, hidden, packed, lead)
        logits = self._logits(inputs, hidden, packed, logits)
        if batch is not None and logits is not None:
            if before_sample is not None:
                before_sample(batch)
            drawn = sample(logits, batch)
        del logits  # the prompt rows' logits need not sit beside them (what profiling measured)
        return drawn, self._score_prompts(inputs, hidden, packed, lead)

    def propose(self, plan: ProposalPlan) -> np.ndarray:
        """Run the proposer's model on ``plan``: its catch-up, then one pass per further draft;
        the drafts, ``[S, max(num_drafts)]`` int64 (row ``i`` valid up to ``num_drafts[i]``).
        Every rank of a tensor-parallel model runs it (the logits are gathered on each, and the
        drafts are greedy, so every rank drafts the same tokens)."""
        model, inputs, forward = self.proposer, plan.inputs, self.proposer_forward
        reads_hidden = getattr(model, "reads_target_hidden", False)
        n, rows = len(inputs.input_ids), len(inputs.logit_rows)
        parts = [inputs.input_ids, inputs.positions, inputs.logit_rows]
        if reads_hidden:
            parts.append(plan.hidden_rows)
        packed = self.memory.from_numpy(np.concatenate(parts))
        args = [packed[:n], packed[n : 2 * n], self.proposer_caches, inputs.meta]
        if reads_hidden:  # the target's hidden states at the catch-up's positions (a row gather)
            args.append(self.ops.embedding(self._target_hidden, packed[2 * n + rows :]))
        hidden = forward(*args)
        self._target_hidden = None
        width = int(plan.num_drafts.max()) if rows else 0
        drafts = np.zeros((rows, width), dtype=np.int64)
        if not rows:
            return drafts
        # Where the sample can stay on the device (sample_async), each pass takes the drafts
        # before it there and the host reads them all at the end, instead of waiting for each
        # pass's. Every rank draws the same greedy drafts from the gathered logits.
        chain = self.ops.has("sample_async")
        pending: list[tuple[np.ndarray, Any]] = []
        last = self.ops.embedding(hidden, packed[2 * n : 2 * n + rows])  # each drafting sequence's last row
        active = np.arange(rows)
        for j in range(width):
            logits = model.compute_logits(last, None)
            if chain:
                drawn = self.ops.sample_async(logits, greedy_batch(len(active)))
                pending.append((active, drawn))
            else:
                drawn = self.ops.sample(logits, greedy_batch(len(active))).token_ids
                drafts[active, j] = drawn
            going = plan.num_drafts[active] > j + 1
            if not going.any():
                break
            active = active[going]
            k = len(active)
            tokens = np.full(k, PLACEHOLDER, dtype=np.int64) if chain else drawn[going]
            step = ragged_inputs(tokens, plan.block_tables[active], plan.last_positions[active] + j + 1,
                                 np.ones(k, dtype=np.int64), self.block_size)
            packed = self.memory.from_numpy(np.concatenate([tokens, step.positions,
                                                            np.flatnonzero(going), np.arange(k)]))
            ids = packed[:k]
            if chain:  # ids[dest] = the draws of the rows still drafting
                ids = drawn.feed(ids, packed[3 * k :], packed[2 * k : 3 * k])
            args = [ids, packed[k : 2 * k], self.proposer_caches, step.meta]
            if reads_hidden:  # its own hidden state stands in for the target's one token ahead
                args.append(self.ops.embedding(last, packed[2 * k : 3 * k]))
            last = forward(*args)
        for j, (rows_j, drawn) in enumerate(pending):
            drafts[rows_j, j] = drawn.result().token_ids
        return drafts


def _every_row_samples(inputs: StepInputs) -> bool:
    """Whether every row of the step samples, in order (a decode step): its logits are the
    head's over all the hidden states, no gather."""
    n, rows = len(inputs.input_ids), inputs.logit_rows
    return len(rows) == n > 0 and rows[0] == 0 and bool((np.diff(rows) == 1).all())


def join_outputs(parts: list[SampleOutput]) -> SampleOutput:
    """Row slices of one output back as one."""
    if len(parts) == 1:
        return parts[0]
    return SampleOutput(*(np.concatenate([getattr(p, name) for p in parts])
                          for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")))


def drafts_ahead(scheduled: list[ScheduledSeq]) -> list[list[int]] | None:
    """Per logit row of ``prepare_inputs``, the drafts its sequence's output is taken to have
    before the token the row samples (the row after its ``j``-th draft samples as if the
    ``j`` drafts were output: its step index, penalties and suppression); None where the step
    verifies no draft."""
    if not any(s.drafts for s in scheduled):
        return None
    ahead: list[list[int]] = []
    for s in scheduled:
        if s.samples:
            ahead += [s.drafts[:j] for j in range(len(s.drafts) + 1)] + [[] for _ in s.forks]
    return ahead


def sampling_batch(seqs: list[Sequence], eos_token_ids: np.ndarray,
                   ahead: list[list[int]] | None = None) -> SamplingBatch:
    """The host-side sampling parameters of the sequences that sample, one row each;
    ``ahead`` (``drafts_ahead``): the drafts each row samples after."""
    params = [s.params for s in seqs]
    first = params[0] if params else None
    shared = bool(params) and all(p is first for p in params)  # LLM.generate's one SamplingParams for all

    def col(name: str, dtype: Any) -> np.ndarray:
        if shared:
            return np.full(len(params), getattr(first, name), dtype=dtype)
        return np.array([getattr(p, name) for p in params], dtype=dtype)

    # the row by row tokens only where some row reads them (a step's hot path: most batches have none)
    penalised = first.penalised if shared else any(p.penalised for p in params)
    biased = first.biased if shared else any(p.biased for p in params)
    ahead = ahead or [()] * len(seqs)

    def history(seq: Sequence, extra: Any) -> list[int]:  # its output and the drafts before the row
        return seq.output_token_ids + extra if extra else seq.output_token_ids

    steps = np.fromiter((len(s.output_token_ids) + len(extra) for s, extra in zip(seqs, ahead)), dtype=np.int64,
                        count=len(seqs))
    suppress = []
    for seq, extra, step in zip(seqs, ahead, steps.tolist()):
        banned = _EMPTY
        # min_tokens: the ways a sequence could end are banned until it has produced enough
        if step < seq.params.min_tokens:
            banned = np.union1d(eos_token_ids, np.array(seq.params.stop_token_ids or [], dtype=np.int64))
        if seq.bad_words:
            banned = np.union1d(banned, bad_words.banned(seq.bad_words, history(seq, extra)))
        suppress.append(banned)
    allowed = None
    if any(s.allowed_tokens is not None for s in seqs):
        # the static part of the bitmask; structured output's matchers narrow it (GrammarMatchers.fill)
        width = next(len(s.allowed_tokens) for s in seqs if s.allowed_tokens is not None)
        allowed = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, seq in enumerate(seqs):
            if seq.allowed_tokens is not None:
                allowed[row] = seq.allowed_tokens
    return SamplingBatch(
        temperature=col("temperature", np.float32),
        top_p=col("top_p", np.float32),
        top_k=col("top_k", np.int64),
        min_p=col("min_p", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        seeds=np.array([s.seed for s in seqs], dtype=np.int64),
        steps=steps,
        # only penalised rows' tokens: another row's output may end in a token still on the
        # device (PLACEHOLDER, asynchronous scheduling), and it would scatter nothing anyway
        prompt_token_ids=[np.asarray(s.prompt_token_ids, dtype=np.int64) if p.penalised else _EMPTY
                          for s, p in zip(seqs, params)] if penalised else [_EMPTY] * len(seqs),
        output_token_ids=[np.asarray(history(s, extra), dtype=np.int64) if p.penalised else _EMPTY
                          for s, p, extra in zip(seqs, params, ahead)] if penalised else [_EMPTY] * len(seqs),
        suppress_token_ids=suppress,
        num_logprobs=max((p.logprobs or 0) for p in params),
        allowed_token_bitmask=allowed,
        # None unless some row has one: sampling then costs nothing extra
        logit_bias=[p.bias_arrays if p.biased else _NO_BIAS for p in params] if biased else None,
    )


def _to_wire(memory: Any, tensor: Any, storage: str) -> np.ndarray:
    """A host copy of a KV tensor as export_kv sends it: bfloat16 as its bits."""
    if storage != "bfloat16":
        return memory.to_numpy(tensor)
    bits = getattr(memory, "to_numpy_bits", None)  # optional (API 1.15)
    if bits is not None:
        return bits(tensor)
    wide = memory.to_numpy(tensor)  # float32, exactly the bfloat16 values: its upper halves
    return (np.ascontiguousarray(wide).view(np.uint32) >> 16).astype(np.uint16)


def _from_wire(memory: Any, array: Any, storage: str) -> Any:
    """``_to_wire``'s array on the device in the cache's ``storage`` dtype. A float32 array for a
    bfloat16 cache (a sender before API 1.15) is cast, exactly. A device connector's tensor
    (already the Memory's, on this device) is taken as it is."""
    if not isinstance(array, np.ndarray):
        return array
    if storage != "bfloat16" or array.dtype != np.uint16:
        return memory.from_numpy(array, storage)
    bits = getattr(memory, "from_numpy_bits", None)
    if bits is not None:
        return bits(array, storage)
    from fd_core.loader.safetensors_io import bf16_to_float32

    return memory.from_numpy(bf16_to_float32(array), storage)
