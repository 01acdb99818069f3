"""CUDA graphs for decode steps: the ``wrap_forward`` hook of the shared model runner.

A decode step (one new token per sequence) of ``S`` sequences runs as the replay of a graph
captured for the smallest bucket ``B >= S``. With speculative decoding (``limits.
num_speculative_tokens`` k), a verification step (each sequence its last token and up to k
drafts) replays a graph of ``q = 1 + k`` rows a sequence, captured per bucket too: a sequence
with fewer tokens is padded inside the graph (rows that write nothing and that nothing reads),
so a step replays whatever drafts the scheduler let each sequence verify; the engine pads
drafts to k all the same (``uniform_drafts``), since a filler costs nothing there and may hold.
The graph was captured with fixed input buffers; a replay first writes the step into them:
token ids and positions (device to device: the runner has uploaded them), and the attention
metadata in two host-to-device copies. The ``B - S``
padding rows are inert: sequence length 0 (their attention reads nothing and writes zeros) and
cache slot -1 (their keys and values are not stored), the rule ``attention.py`` documents.

Where the runner attaches the model's head (``attach_head``), each decode graph also computes
the logits of every row after the forward (``with_head``), so a decode step's LM head is part of
the replay. Where it attaches this backend's own ``sample_async`` too (``attach_sampler``), the
graph then runs the sampling kernel over those logits, reading the rows' parameters from a
buffer written before the replay (``with_sample``): a batch the kernel samples alone (no bias,
penalties, suppressed tokens, bitmask or top logprobs) costs the host no sampler launch. For any
other batch the graph's draw is ignored and the op samples the logits as before.

Every other step — prefill chunks alone or beside decodes — replays a *mixed* graph captured
for the smallest token bucket ``T`` that holds it (``mixed_capture_sizes``: 64 to 8192 tokens,
``FD_CUDA_MIXED_GRAPH_TOKENS`` the largest, 0 for none) and ``max_num_seqs`` sequences: its
attention plan is ``attention.MixedPlan``, fixed launches over as many work items as such a step
can have, whose unused items and rows are inert. Eagerly, a mixed step's ~250 launches cost the
host 14-20 ms at the median (H200 host, ERNIE-4.5-0.3B shape, 64 decodes beside 2-8 prompts
of 256 tokens: ``gpu_profile.py --load mixed``), many times the GPU's work, and every running
stream waited that long for its next token. Only steps with more tokens than the largest bucket, and the
runner's ``eager`` steps, run eagerly through the same ops.

Every graph is captured at start-up, once the KV cache exists (``warm_up``), each after one
eager run of its shape (Triton compiles, launch plans and split-K scratch are made then), into
one memory pool shared by all: only one graph runs at a time, and its output is consumed before
the next replay.

The split-K factor of a bucket's attention is fixed at capture for the longest sequence the
engine allows (``max_model_len``); a shorter sequence leaves some splits empty, which the
merge of the splits ignores.
"""

from __future__ import annotations

import bisect
import gc
import os
from typing import Any, Callable

import numpy as np
import torch
from fd_core.errors import ConfigError
from fd_core.interfaces import AttentionMetadata, RunnerLimits
from fd_core.phases import phase
from fd_core.runtimes.torch.ops import upload

from fd_backend_cuda.kernels import sampling
from fd_backend_cuda.kernels._common import sm_count
from fd_backend_cuda.kernels.advance import advance
from fd_backend_cuda.kernels.attention import SPLIT_MASK_KEYS, MixedPlan, static_step_tensors

MIXED_GRAPH_TOKENS = 8192  # the largest mixed bucket by default (FD_CUDA_MIXED_GRAPH_TOKENS)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to 64, then every 16
    (as in vLLM, padding a batch costs at most ~12% of its rows), and max_num_seqs itself."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts of mixed steps that get a graph: 64, 128, 256, then alternately x1.5 and
    x4/3 (384, 512, 768, 1024, 1536, ...: past 256 tokens, padding is at most a third of a
    bucket's rows), up to ``max_tokens``, which is included. 13 graphs up to 8,192."""
    sizes, size = [], 64
    while size < max_tokens:
        sizes.append(size)
        size = size * 2 if size < 256 else (size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3)
    return sizes + [max_tokens] if max_tokens > 0 else []


def mixed_graph_tokens(limits: RunnerLimits) -> int:
    """The largest mixed bucket: ``FD_CUDA_MIXED_GRAPH_TOKENS`` (0 turns mixed graphs off), else
    ``MIXED_GRAPH_TOKENS``, never above the step budget."""
    raw = os.environ.get("FD_CUDA_MIXED_GRAPH_TOKENS", "").strip()
    try:
        cap = int(raw) if raw else MIXED_GRAPH_TOKENS
    except ValueError:
        raise ConfigError(f"FD_CUDA_MIXED_GRAPH_TOKENS must be a whole number of tokens, got {raw!r}") from None
    if cap < 0:
        raise ConfigError(f"FD_CUDA_MIXED_GRAPH_TOKENS must be 0 (off) or more, got {cap}")
    return min(cap, limits.max_num_batched_tokens)


def _smallest(sizes: list[int], n: int) -> int | None:
    """The smallest of the ascending ``sizes`` that holds ``n`` (None: none does)."""
    at = bisect.bisect_left(sizes, n)
    return sizes[at] if at < len(sizes) else None


def _captured(run: Callable[[], Any], pool: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``run`` once eagerly (Triton compiles, launch plans and scratch are made then), then
    captured into a graph in ``pool``: the graph and what the captured ``run`` returned."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # No garbage collection while capturing: a dropped engine's graphs, held in a reference
    # cycle, destroyed by a collection that a capture's allocations set off, invalidate the
    # capture (a graph may not be destroyed while a stream captures; seen in the conformance
    # kit, which builds engines one after another in one process). They go at a later collection.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            output = run()
    finally:
        if collecting:
            gc.enable()
    return graph, output


def _upload_tables(meta: AttentionMetadata, into: torch.Tensor) -> None:
    """The step's block tables into the first rows and columns of a graph's buffer (the rest
    is stale and unread: each sequence reads only its own blocks)."""
    tables = meta.block_tables
    if tables.ndim == 2 and tables.shape[1]:
        upload(tables.astype(np.int32), into.device, into=into[: tables.shape[0], : tables.shape[1]])


class _MixedGraph:
    """One mixed bucket: any step of at most ``tokens`` tokens and ``max_num_seqs`` sequences,
    its rows padded to ``tokens``. The padding rows compute values nothing reads."""

    def __init__(self, tokens: int, limits: RunnerLimits, device: torch.device,
                 block_tables: torch.Tensor | None = None) -> None:
        s = limits.max_num_seqs
        self.tokens = tokens
        # warm-up and capture: every sequence empty, every slot -1 (nothing written)
        self.meta = AttentionMetadata(
            query_start_loc=np.zeros(s + 1, dtype=np.int64),
            seq_lens=np.zeros(s, dtype=np.int64),
            context_lens=np.zeros(s, dtype=np.int64),
            block_tables=np.zeros((s, 1), dtype=np.int64),
            slot_mapping=np.full(tokens, -1, dtype=np.int64),
            block_size=limits.block_size,
        )
        self.plan = MixedPlan(self.meta, s, tokens, -(-limits.max_model_len // limits.block_size),
                              limits.max_model_len, device, block_tables)
        upload(self.plan.host, device, into=self.plan.buffer)
        self.ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None

    def capture(self, forward: Callable[..., Any], kv_caches: list, pool: Any) -> None:
        self.graph, self.output = _captured(lambda: forward(self.ids, self.positions, kv_caches, self.meta), pool)

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = ids.shape[0]
        self.ids[:n].copy_(ids)  # rows past n keep earlier valid ids and positions
        self.positions[:n].copy_(positions)
        device = self.ids.device
        upload(self.plan.fill(meta), device, into=self.plan.buffer)
        _upload_tables(meta, self.plan.block_tables)
        self.graph.replay()
        return self.output[:n]


class _Graph:
    """One bucket: the captured graph, its input buffers and its output. ``q``: the tokens each
    sequence computes (1 for decodes, 1 + k for verification steps)."""

    def __init__(self, size: int, limits: RunnerLimits, device: torch.device, q: int = 1) -> None:
        self.size, self.q = size, q
        n = size * q
        max_len = limits.max_model_len
        # Host metadata that plans the attention launches at warm-up: every sequence as long
        # as the engine allows, so the split-K factor suits the longest decode.
        self.meta = AttentionMetadata(
            query_start_loc=np.arange(size + 1, dtype=np.int64) * q,
            seq_lens=np.full(size, max_len, dtype=np.int64),
            context_lens=np.full(size, max_len - q, dtype=np.int64),
            block_tables=np.zeros((size, 1), dtype=np.int64),
            slot_mapping=np.full(n, -1, dtype=np.int64),
            block_size=limits.block_size,
        )
        self.max_blocks = -(-max_len // limits.block_size)
        self.tensors, self.packed_device = static_step_tensors(self.meta, device, self.max_blocks)
        self.tensors.slot_mapping.fill_(-1)  # warm-up and capture write nothing to the cache
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.packed = np.zeros(2 * size + n, dtype=np.int32)  # seq_lens | context_lens | slot mapping
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None  # the head's, where one was captured
        self.params: torch.Tensor | None = None  # the rows' sampling parameters, where a draw was captured
        self.drawn: torch.Tensor | None = None  # its int64 [size, 4] rows (sampling.launch_draw)

    def capture(self, forward: Callable[..., Any], kv_caches: list, pool: Any,
                head: Callable[..., Any] | None = None,
                scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``scratch``: the draw's ``(ids, xs)`` rows (``sampling.launch_draw``), shared by every
        graph (one replays at a time); given with ``head``, the graph draws after it."""
        device = self.ids.device
        if head is not None and scratch is not None:  # greedy until a replay writes the rows' parameters
            self.params = torch.zeros(self.size, 6, dtype=torch.int64, device=device)
            draw_scratch = (scratch[0][: self.size], scratch[1][: self.size])

        def run() -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            hidden = forward(self.ids, self.positions, kv_caches, self.meta)
            logits = None if head is None else head(hidden, None)
            if self.params is None:
                return hidden, logits, None
            drawn = torch.empty(self.size, 4, dtype=torch.int64, device=device)
            return hidden, logits, sampling.launch_draw(logits, logits, self.params, drawn, *draw_scratch)

        self.graph, (self.output, self.logits, self.drawn) = _captured(run, pool)

    def replay_sample(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      batch: Any) -> tuple[torch.Tensor, torch.Tensor, sampling.DeviceSample]:
        """``replay_head`` with the captured draw over the batch's rows (``sampling.is_plain``)."""
        vocab = self.logits.shape[1]
        upload(sampling.batch_params(batch, vocab), self.params.device, into=self.params[: meta.num_seqs])
        hidden, logits = self.replay_head(ids, positions, meta)
        # the next step's feed reads these rows on the device before its replay writes them again
        return hidden, logits, sampling.DeviceSample(self.drawn[: meta.num_seqs], 0)

    def advance_sample(self, num_seqs: int) -> sampling.DeviceSample:
        """The step after the last ``replay_sample`` or ``advance_sample`` of ``num_seqs``
        sequences, its inputs made on the device (``kernels/advance.py``): nothing is uploaded."""
        advance(self.ids, self.positions, self.packed_device, self.tensors.block_tables, self.params, self.drawn,
                num_seqs, self.meta.block_size, sampling.PARAM_STEP)
        self.graph.replay()
        return sampling.DeviceSample(self.drawn[:num_seqs], 0)

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.replay_head(ids, positions, meta)[0]

    def replay_head(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's hidden states. A sequence with fewer than ``q`` tokens (a verification
        step where some have fewer drafts) has them at the head of its ``q`` rows: the rest are
        padding, whose keys and values are not written (slot -1) and whose outputs are not
        read, and which no real row attends to (a row sees keys up to its own position)."""
        s, n, q = meta.num_seqs, self.size, self.q  # sequences, bucket, rows a sequence
        num = len(meta.slot_mapping)
        packed = self.packed
        packed[:s] = meta.seq_lens
        packed[s:n] = 0
        packed[n : n + s] = meta.context_lens
        packed[n + s : 2 * n] = 0
        slots = packed[2 * n :]
        device = self.packed_device.device
        index = None
        if num == s * q:  # every sequence has q tokens: rows in order
            self.ids[:num].copy_(ids)  # rows past num keep earlier valid ids and positions
            self.positions[:num].copy_(positions)
            slots[:num] = meta.slot_mapping
            slots[num:] = -1
        else:
            qsl = np.asarray(meta.query_start_loc, dtype=np.int64)
            rows = np.repeat(np.arange(s, dtype=np.int64) * q - qsl[:-1], np.diff(qsl)) + np.arange(num)
            slots.fill(-1)
            slots[rows] = meta.slot_mapping
            index = upload(rows, device)
            self.ids.index_copy_(0, index, ids)  # padding rows keep earlier valid ids and positions
            self.positions.index_copy_(0, index, positions)
        upload(packed, device, into=self.packed_device)
        _upload_tables(meta, self.tensors.block_tables)
        self.graph.replay()
        if index is not None:
            return self.output.index_select(0, index), None
        return self.output[:num], None if self.logits is None else self.logits[:num]


class CudaGraphHooks:
    """``ModelRunnerHooks`` of the cuda platform."""

    def wrap_forward(self, forward: Callable[..., Any], limits: RunnerLimits) -> Callable[..., Any]:
        return GraphedForward(forward, limits)


class GraphedForward:
    """The model forward with decode steps, and verification steps of one shape, replayed from
    captured graphs."""

    def __init__(self, forward: Callable[..., Any], limits: RunnerLimits) -> None:
        self.forward = forward
        self.limits = limits
        self.sizes = capture_sizes(limits.max_num_seqs)
        # verification steps: each sequence's last token and k drafts (1.13; an older core's
        # limits have no such field), in buckets whose tokens fit the step's budget
        k = getattr(limits, "num_speculative_tokens", 0)
        self.verify_q = 1 + k if k else None
        self.verify_sizes = [s for s in self.sizes if s * (1 + k) <= limits.max_num_batched_tokens] if k else []
        self.uniform_drafts = bool(self.verify_sizes)  # the engine pads drafts to k (API 1.13)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mixed_sizes = mixed_capture_sizes(mixed_graph_tokens(limits))
        self.mixed_graphs: dict[int, _MixedGraph] = {}
        self.mixed_replays = 0
        self.head: Callable[..., Any] | None = None
        self.sampler = False  # the decode graphs draw too (attach_sampler)
        self.draws = 0  # decode steps whose tokens a graph drew
        self.advances = 0  # of those, steps whose inputs the last one's graph made (advance_sample)
        # the graph that drew the last step, and its sequences, while nothing else has run since
        self._drew: tuple[_Graph, int] | None = None
        self._draw_scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pool = None
        self.kv_caches: list | None = None
        self.replays = 0
        self.verify_replays = 0  # of those, verification steps

    def attach_head(self, head: Callable[..., Any]) -> None:
        """Capture ``head`` (the model's logits of every row) into each decode graph after the
        forward: the LM head's matmul then costs the host nothing (cuBLAS's launch took 70-80 us
        of a batch-1 step's host time, H200 host). Before ``warm_up``."""
        self.head = head
        self.graphs.clear()
        self._drew = None

    def attach_sampler(self, sample: Callable[..., Any]) -> bool:
        """Draw in each decode graph, after the head, where ``sample`` (the runner's chosen
        ``sample_async``) is this backend's: another implementation (``--op sample_async=...``)
        is left to run as the runner calls it. Before ``warm_up``; returns whether it draws."""
        from fd_backend_cuda import ops  # the op module imports this one

        self.sampler = self.head is not None and sample is ops.sample_async
        self.graphs.clear()
        self._drew = None
        return self.sampler

    def mixed_bucket(self, num_tokens: int) -> int | None:
        return _smallest(self.mixed_sizes, num_tokens)

    def bucket(self, num_seqs: int, q: int = 1) -> int | None:
        return _smallest(self.sizes if q == 1 else self.verify_sizes, num_seqs)

    def warm_up(self, kv_caches: list, device: str | torch.device) -> None:
        """Capture every bucket now that the KV cache exists, largest first (the pool then
        holds the largest activations once, and smaller graphs reuse that memory)."""
        device = torch.device(device)  # the attention op keys its metadata by q.device
        if self.mixed_sizes:  # the largest activations first (see above)
            with phase(f"capturing CUDA graphs for {len(self.mixed_sizes)} mixed-step token counts") as step:
                for size in sorted(self.mixed_sizes, reverse=True):
                    self._mixed_graph(size, kv_caches, device)
                step.detail = f"steps of up to {', '.join(map(str, self.mixed_sizes))} tokens"
        # the engine's start-up phases: a line each as they start and end, with the duration
        with phase(f"capturing CUDA graphs for {len(self.sizes)} decode batch sizes") as step:
            for size in sorted(self.sizes, reverse=True):
                self._graph(size, kv_caches, device)
            step.detail = f"batches of {', '.join(map(str, self.sizes))} sequences"
        if self.verify_sizes:
            with phase(f"capturing CUDA graphs for {len(self.verify_sizes)} verification batch sizes") as step:
                for size in sorted(self.verify_sizes, reverse=True):
                    self._graph(size, kv_caches, device, self.verify_q)
                step.detail = f"batches of {', '.join(map(str, self.verify_sizes))} sequences of {self.verify_q} tokens"
        with phase("compiling the kernels of eager steps") as step:
            step.detail = f"{self.warm_eager_steps(kv_caches, device)} synthetic steps"

    def warm_eager_steps(self, kv_caches: list, device: torch.device) -> int:
        """Run, at start-up, eager steps shaped so that every attention launch variant an
        eager (prefill or mixed) step can pick gets compiled now rather than in the middle of
        serving (a Triton compile stalls every stream for a second or more): both tiles — one
        token per sequence, and chunks of 32 — at every split-K factor, which the planner
        derives from the number of programs and the longest key range, and chunks over short
        and long key ranges (``attention.SPLIT_MASK_KEYS``). The steps read block 0, which no
        sequence owns, and write nothing (slot -1)."""
        limits = self.limits
        num_kv_heads = kv_caches[0][0].shape[1]
        sms = sm_count(device)
        steps = 0
        # (tokens a sequence, keys): 8192 keys are enough for the most splits
        ranges = [(1, 8192 + 1), (32, 8192 + 32), (32, SPLIT_MASK_KEYS - 1)]
        for chunk, keys in dict.fromkeys((chunk, min(limits.max_model_len, keys)) for chunk, keys in ranges):
            seqs = 1
            while seqs * chunk <= limits.max_num_batched_tokens and seqs * num_kv_heads <= 2 * sms:
                n = seqs * chunk
                meta = AttentionMetadata(
                    query_start_loc=np.arange(seqs + 1, dtype=np.int64) * chunk,
                    seq_lens=np.full(seqs, keys, dtype=np.int64),
                    context_lens=np.full(seqs, keys - chunk, dtype=np.int64),
                    block_tables=np.zeros((seqs, -(-keys // limits.block_size)), dtype=np.int64),
                    slot_mapping=np.full(n, -1, dtype=np.int64),
                    block_size=limits.block_size,
                )
                positions = torch.from_numpy(np.tile(np.arange(keys - chunk, keys), seqs)).to(device)
                self.forward(torch.zeros(n, dtype=torch.int64, device=device), positions, kv_caches, meta)
                steps += 1
                seqs *= 2
        torch.cuda.synchronize()
        return steps

    def _stale(self, kv_caches: list) -> None:
        if kv_caches is not self.kv_caches:  # a new KV cache: graphs captured on the old are stale
            self.graphs.clear()
            self._drew = None
            self.mixed_graphs.clear()
            self.kv_caches = kv_caches
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

    def _mixed_graph(self, size: int, kv_caches: list, device: torch.device) -> _MixedGraph:
        self._stale(kv_caches)
        graph = self.mixed_graphs.get(size)
        if graph is None:
            shared = next(iter(self.mixed_graphs.values())).plan.block_tables if self.mixed_graphs else None
            graph = _MixedGraph(size, self.limits, device, shared)  # one block-table buffer for all
            graph.capture(self.forward, kv_caches, self.pool)
            self.mixed_graphs[size] = graph
        return graph

    def _graph(self, size: int, kv_caches: list, device: torch.device, q: int = 1) -> _Graph:
        self._stale(kv_caches)
        graph = self.graphs.get((size, q))
        if graph is None:
            graph = _Graph(size, self.limits, device, q)
            scratch = None
            if self.sampler and q == 1:
                if self._draw_scratch is None:
                    rows = max(self.sizes)
                    self._draw_scratch = (torch.empty(rows, sampling.CAP, dtype=torch.int32, device=device),
                                          torch.empty(rows, sampling.CAP, dtype=torch.float32, device=device))
                scratch = self._draw_scratch
            graph.capture(self.forward, kv_caches, self.pool, self.head if q == 1 else None, scratch)
            self.graphs[(size, q)] = graph
        return graph

    def _shape(self, num_tokens: int, meta: AttentionMetadata) -> int | None:
        """The rows a sequence has in the graph that runs the step: 1 (decodes), or 1 + k
        where no sequence computes more than 1 + k tokens (a verification step; one with
        fewer is padded); None otherwise (a longer prefill chunk: eager)."""
        num_seqs = meta.num_seqs
        if num_tokens == num_seqs:
            return 1
        q = self.verify_q
        if q and np.diff(meta.query_start_loc).max() <= q:
            return q
        return None

    def _decode_graph(self, ids: torch.Tensor, kv_caches: list, meta: AttentionMetadata) -> _Graph | None:
        """The graph with the attached head that replays this step, if it is a decode one holds."""
        if self.head is None or ids.device.type != "cuda" or self._shape(ids.shape[0], meta) != 1:
            return None
        size = self.bucket(meta.num_seqs)
        if size is None:
            return None
        self.replays += 1
        return self._graph(size, kv_caches, ids.device)

    def with_head(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                  meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A decode step's hidden states and the attached head's logits of every row, from one
        replay; None where the step is not a decode a graph holds (the caller runs the head)."""
        self._drew = None
        graph = self._decode_graph(ids, kv_caches, meta)
        return None if graph is None else self._replay_head(graph, ids, positions, meta)

    def _replay_head(self, graph: _Graph, ids: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, logits = graph.replay_head(ids, positions, meta)
        return hidden, self.head(hidden, None) if logits is None else logits

    def with_sample(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: AttentionMetadata,
                    batch: Any) -> tuple[torch.Tensor, torch.Tensor, sampling.DeviceSample | None] | None:
        """``with_head``'s hidden states and logits, and the graph's draw of the batch's rows
        where the kernel samples them alone (else None: the runner samples the logits); None
        where the step is not a decode a graph holds."""
        self._drew = None
        graph = self._decode_graph(ids, kv_caches, meta)
        if graph is None:
            return None
        if graph.params is None or not sampling.is_plain(batch):
            return (*self._replay_head(graph, ids, positions, meta), None)
        self.draws += 1
        drawn = graph.replay_sample(ids, positions, meta, batch)
        self._drew = (graph, meta.num_seqs)
        return drawn

    def advance_sample(self, batch: Any) -> sampling.DeviceSample | None:
        """The decode step after the last one, which a graph drew (``with_sample`` or this):
        the same sequences one position further, each fed the token drawn for it, ``batch``
        the last step's with each row's step one further (API 1.21). The graph's own buffers
        are moved on by one kernel; nothing is uploaded. None where the last call was not such
        a draw."""
        if self._drew is None:
            return None
        graph, num_seqs = self._drew
        self.replays += 1
        self.draws += 1
        self.advances += 1
        return graph.advance_sample(num_seqs)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                 meta: AttentionMetadata) -> torch.Tensor:
        self._drew = None
        q = self._shape(ids.shape[0], meta) if ids.device.type == "cuda" else None
        size = None if q is None else self.bucket(meta.num_seqs, q)
        if size is None:
            mixed = self.mixed_bucket(ids.shape[0]) if ids.device.type == "cuda" else None
            if mixed is None:
                return self.forward(ids, positions, kv_caches, meta)  # more tokens than any bucket: eager
            self.mixed_replays += 1
            return self._mixed_graph(mixed, kv_caches, ids.device).replay(ids, positions, meta)
        self.replays += 1
        self.verify_replays += q > 1
        return self._graph(size, kv_caches, ids.device, q).replay(ids, positions, meta)
