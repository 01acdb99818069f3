"""The one model runner every backend shares.

It turns a scheduled step into host arrays (token ids, positions, attention metadata, sampling
parameters), moves them to the device through the backend's Memory, runs the model through the
op table, and samples. Nothing here knows which chip or tensor library it drives; a backend
adds chip-specific steps through ``ModelRunnerHooks`` (e.g. replaying captured graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_core.engine.scheduler import ScheduledSeq
from fd_core.engine.sequence import Sequence
from fd_core.interfaces import (
    AttentionMetadata,
    Memory,
    ModelRunnerHooks,
    SampleOutput,
    SamplingBatch,
)

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class StepResult:
    """Sampled tokens, one row per sequence in ``sampled``: the scheduled sequences whose step
    reached their end, each followed by the siblings waiting to fork from it (they sample from
    the same logits, each with its own seed)."""

    sampled: list[Sequence]
    output: SampleOutput | None


@dataclass
class StepInputs:
    """What every rank needs to run one step's forward: host arrays only, so that rank 0 can
    send them to the others of a tensor-parallel model."""

    input_ids: np.ndarray  # [N] int64
    positions: np.ndarray  # [N] int64
    meta: AttentionMetadata
    logit_rows: np.ndarray  # [R] int64: the hidden rows whose logits are sampled


def prepare_inputs(scheduled: list[ScheduledSeq], block_size: int) -> tuple[StepInputs, list[Sequence]]:
    """The step's inputs, and the sequences that sample, one per logit row in that order: each
    scheduled sequence whose step reaches its end, followed by the siblings waiting to fork from
    it (they sample from the same row, each with its own seed)."""
    num_seqs = len(scheduled)
    query_lens = np.array([s.num_new for s in scheduled], dtype=np.int64)
    context_lens = np.array([s.seq.num_computed for s in scheduled], dtype=np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    max_blocks = max(len(s.seq.block_table) for s in scheduled)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    ids_parts, pos_parts = [], []
    sampled: list[Sequence] = []
    rows: list[int] = []
    for i, s in enumerate(scheduled):
        table = s.seq.block_table
        block_tables[i, : len(table)] = table
        start = s.seq.num_computed
        ids_parts.append(np.asarray(s.seq.tokens_between(start, start + s.num_new), dtype=np.int64))
        pos_parts.append(np.arange(start, start + s.num_new, dtype=np.int64))
        if s.samples:
            for seq in (s.seq, *s.seq.forks):
                sampled.append(seq)
                rows.append(int(query_start_loc[i + 1]) - 1)
    positions = np.concatenate(pos_parts)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(
        query_start_loc=query_start_loc,
        seq_lens=context_lens + query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        slot_mapping=slot_mapping.astype(np.int64),
        block_size=block_size,
    )
    inputs = StepInputs(np.concatenate(ids_parts), positions, meta, np.asarray(rows, dtype=np.int64))
    return inputs, sampled


class ModelRunner:
    """One rank's model, KV cache and swap space."""

    def __init__(self, model: Any, ops: Any, memory: Memory, block_size: int,
                 hooks: ModelRunnerHooks | None = None) -> None:
        self.model = model
        self.ops = ops
        self.memory = memory
        self.block_size = block_size
        self.kv_caches: list[tuple[Any, Any]] = []
        self.host_caches: list[tuple[Any, Any]] = []  # swap space
        self.forward = model.forward
        wrap = getattr(hooks, "wrap_forward", None) if hooks is not None else None
        if wrap is not None:
            self.forward = wrap(model.forward)

    def _allocate(self, allocate: Any, num_blocks: int, dtype: str) -> list[tuple[Any, Any]]:
        m = self.model  # its own heads: a tensor-parallel rank holds a slice
        return allocate(m.config.num_hidden_layers, num_blocks, self.block_size, m.num_kv_heads, m.head_dim, dtype)

    def memory_info(self) -> tuple[int, int]:
        return self.memory.memory_info()

    def initialize_kv_cache(self, num_blocks: int, dtype: str = "float32") -> None:
        self.kv_caches = self._allocate(self.memory.allocate_kv_cache, num_blocks, dtype)

    def initialize_swap_space(self, num_blocks: int, dtype: str = "float32") -> None:
        self.host_caches = self._allocate(self.memory.allocate_host_kv_cache, num_blocks, dtype)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.swap_blocks(self.kv_caches, self.host_caches, self.block_size, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.swap_blocks(self.host_caches, self.kv_caches, self.block_size, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.copy_blocks(self.kv_caches, self.block_size, pairs)

    def run(self, inputs: StepInputs) -> Any:
        """Forward over the step and the logits of its sampling rows (None if there are none).
        Every rank of a tensor-parallel model runs this with the same inputs."""
        to = self.memory.from_numpy
        ids = to(self.model.local_token_ids(inputs.input_ids))
        hidden = self.forward(ids, to(inputs.positions), self.kv_caches, inputs.meta)
        if not len(inputs.logit_rows):
            return None
        return self.model.compute_logits(hidden, to(inputs.logit_rows))

    def step(self, inputs: StepInputs, batch: SamplingBatch | None) -> SampleOutput | None:
        """``run``, then sample the logits with ``batch`` (a tensor-parallel rank other than 0
        is given None: it only takes part in the forward's collectives)."""
        logits = self.run(inputs)
        if batch is None or logits is None:
            return None
        return self.ops.sample(logits, batch)


def sampling_batch(seqs: list[Sequence], eos_token_ids: np.ndarray) -> SamplingBatch:
    """The host-side sampling parameters of the sequences that sample, one row each."""
    params = [s.params for s in seqs]

    def col(name: str, dtype: Any) -> np.ndarray:
        return np.array([getattr(p, name) for p in params], dtype=dtype)

    penalised = any(
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1 for p in params
    )
    suppress = []
    for seq in seqs:
        # min_tokens: the ways a sequence could end are banned until it has produced enough
        if len(seq.output_token_ids) < seq.params.min_tokens:
            stop_ids = np.array(seq.params.stop_token_ids or [], dtype=np.int64)
            suppress.append(np.union1d(eos_token_ids, stop_ids))
        else:
            suppress.append(_EMPTY)
    return SamplingBatch(
        temperature=col("temperature", np.float32),
        top_p=col("top_p", np.float32),
        top_k=col("top_k", np.int64),
        min_p=col("min_p", np.float32),
        presence_penalty=col("presence_penalty", np.float32),
        frequency_penalty=col("frequency_penalty", np.float32),
        repetition_penalty=col("repetition_penalty", np.float32),
        seeds=np.array([s.seed for s in seqs], dtype=np.int64),
        steps=np.array([len(s.output_token_ids) for s in seqs], dtype=np.int64),
        prompt_token_ids=[np.asarray(s.prompt_token_ids, dtype=np.int64) if penalised else _EMPTY for s in seqs],
        output_token_ids=[np.asarray(s.output_token_ids, dtype=np.int64) if penalised else _EMPTY for s in seqs],
        suppress_token_ids=suppress,
        num_logprobs=max((p.logprobs or 0) for p in params),
    )
