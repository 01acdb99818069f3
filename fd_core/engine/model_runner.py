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


class ModelRunner:
    def __init__(self, model: Any, ops: Any, memory: Memory, block_size: int,
                 eos_token_ids: frozenset[int] = frozenset(), hooks: ModelRunnerHooks | None = None) -> None:
        self.model = model
        self.ops = ops
        self.memory = memory
        self.block_size = block_size
        self.eos_token_ids = np.array(sorted(eos_token_ids), dtype=np.int64)
        self.kv_caches: list[tuple[Any, Any]] = []
        self.host_caches: list[tuple[Any, Any]] = []  # swap space
        self.forward = model.forward
        wrap = getattr(hooks, "wrap_forward", None) if hooks is not None else None
        if wrap is not None:
            self.forward = wrap(model.forward)

    def initialize_kv_cache(self, num_blocks: int, dtype: str = "float32") -> None:
        c = self.model.config
        self.kv_caches = self.memory.allocate_kv_cache(
            c.num_hidden_layers, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim, dtype
        )

    def initialize_swap_space(self, num_blocks: int, dtype: str = "float32") -> None:
        c = self.model.config
        self.host_caches = self.memory.allocate_host_kv_cache(
            c.num_hidden_layers, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim, dtype
        )

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.swap_blocks(self.kv_caches, self.host_caches, self.block_size, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.swap_blocks(self.host_caches, self.kv_caches, self.block_size, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.memory.copy_blocks(self.kv_caches, self.block_size, pairs)

    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        ids, positions, meta, rows = self._prepare(scheduled)
        to = self.memory.from_numpy
        hidden = self.forward(to(ids), to(positions), self.kv_caches, meta)
        sampled: list[Sequence] = []
        row_index: list[int] = []
        for i in rows:
            seq = scheduled[i].seq
            for s in (seq, *seq.forks):
                sampled.append(s)
                row_index.append(int(meta.query_start_loc[i + 1]) - 1)
        if not sampled:
            return StepResult([], None)
        logits = self.model.compute_logits(hidden, to(np.asarray(row_index, dtype=np.int64)))
        return StepResult(sampled, self.ops.sample(logits, self._sampling_batch(sampled)))

    def _prepare(self, scheduled: list[ScheduledSeq]):
        bs = self.block_size
        num_seqs = len(scheduled)
        query_lens = np.array([s.num_new for s in scheduled], dtype=np.int64)
        context_lens = np.array([s.seq.num_computed for s in scheduled], dtype=np.int64)
        seq_lens = context_lens + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        ids_parts, pos_parts = [], []
        for i, s in enumerate(scheduled):
            table = s.seq.block_table
            block_tables[i, : len(table)] = table
            start = s.seq.num_computed
            ids_parts.append(np.asarray(s.seq.tokens[start : start + s.num_new], dtype=np.int64))
            pos_parts.append(np.arange(start, start + s.num_new, dtype=np.int64))
        ids = np.concatenate(ids_parts)
        positions = np.concatenate(pos_parts)
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping.astype(np.int64),
            block_size=bs,
        )
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        return ids, positions, meta, rows

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
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
                suppress.append(np.union1d(self.eos_token_ids, stop_ids))
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
