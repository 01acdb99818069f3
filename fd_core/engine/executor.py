"""Running the model on every rank.

With ``--tensor-parallel-size 1`` the Executor is a thin shell around one ModelRunner in the
engine's own process. With more, every rank is a worker process (``python -m
fd_core.engine.executor``, plain subprocesses: the engine-core process of ``fd serve`` is a
daemon and may not fork multiprocessing children), and the engine's process joins no process
group: it sends each call — KV-cache set-up, swaps, block copies, a step's inputs and sampling
parameters — to all ranks, which run the same forward and meet in its collectives; rank 0
samples and answers with the tokens. Every rank answers every call, so a failure on any rank,
or a rank that dies (leaving the others stuck in a collective), surfaces in the engine as a
BackendError, never as a wait without end. Several engines may live in one process.

Messages are pickled tuples over ZeroMQ (local IPC, one trusted parent): the inputs are NumPy
arrays and small dataclasses.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from fd_core.engine.block_rows import BlockTableRows
from fd_core.engine.config import EngineConfig
from fd_core.engine.model_runner import (
    PLACEHOLDER,
    Feed,
    Launched,
    ModelRunner,
    ProposalPlan,
    Scored,
    StepInputs,
    StepResult,
    drafts_ahead,
    prepare_inputs,
    sampling_batch,
)
from fd_core.engine.parent import watch_parent
from fd_core.engine.rounds import later_batch, later_inputs
from fd_core.engine.scheduler import ScheduledSeq
from fd_core.engine.sequence import Sequence
from fd_core.errors import BackendError, FdError
from fd_core.heap import freeze_startup_heap
from fd_core.interfaces import DeferredBitmask, SampleOutput, SamplingBatch
from fd_core.logs import configure, effective_level, parse_level, rank_level

log = logging.getLogger("fd.engine")

# completes a step's SamplingBatch for its sampling sequences (structured output's bitmask)
Fill = Callable[[list[Sequence], SamplingBatch], None]

_REPLY_POLL_MS = 100
_START_TIMEOUT_S = 900.0
_DEATH_GRACE_S = 0.5  # how long a rank's failure waits for another rank's exit to be seen


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def rendezvous_address(world_size: int) -> str:
    """``host:port,port,...``: one free local port per rank; a runtime uses what it needs."""
    return "127.0.0.1:" + ",".join(str(p) for p in free_ports(world_size))


class Workers:
    """All ranks of a tensor-parallel model as processes, seen from the engine."""

    def __init__(self, config: EngineConfig, world_size: int, rendezvous: str) -> None:
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="fd-tp-")
        self._ctx = zmq.Context()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir}/replies")
        self._senders: list[zmq.Socket] = []
        self._procs: list[subprocess.Popen] = []
        for rank in range(world_size):
            sender = self._ctx.socket(zmq.PUSH)
            sender.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{self._dir}/rank{rank}"
            sender.bind(address)
            self._senders.append(sender)
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "fd_core.engine.executor", "--rank", str(rank), "--calls", address,
                 "--replies", f"ipc://{self._dir}/replies", "--parent", str(os.getpid()),
                 "--log-level", str(effective_level())],
            ))
        self._closing = False
        atexit.register(self.close)  # an engine never shut down still stops its ranks
        self._send(("init", config, world_size, rendezvous))

    def dead(self) -> tuple[int, int | None] | None:
        """``(rank, exit code)`` of a worker that is gone, if any."""
        for rank, proc in enumerate(self._procs):
            if proc.poll() is not None:
                return rank, proc.returncode
        return None

    def _dead_within(self, seconds: float) -> tuple[int, int | None] | None:
        deadline = time.monotonic() + seconds
        while (gone := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return gone

    def _send(self, message: tuple, timeout: float = _START_TIMEOUT_S) -> None:
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, sender in enumerate(self._senders):
            # A PUSH socket with no peer (not connected yet, or gone) would block for ever:
            # retry without blocking while the rank's process lives.
            deadline = time.monotonic() + timeout
            while True:
                try:
                    sender.send(frame, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    code = self._procs[rank].poll()
                    if code is not None or time.monotonic() > deadline:
                        why = f"exited with code {code}" if code is not None else "is not receiving"
                        raise BackendError(f"tensor-parallel rank {rank} {why}") from None
                    time.sleep(0.01)

    def call(self, method: str, *args: Any) -> None:
        """Start ``method(*args)`` on every worker's runner; ``wait`` collects the answers."""
        self._send(("call", method, args))

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Every rank's answer to its last message, by rank; raises if one failed or died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            if self._replies.poll(_REPLY_POLL_MS):
                rank, ok, detail = pickle.loads(self._replies.recv())
                if not ok:
                    # A rank that died makes the others' collectives fail: report the cause, not
                    # the symptom. Its sockets close before its exit can be reaped, so the
                    # survivor's error may come first: give the exit a moment to show.
                    gone = self._dead_within(_DEATH_GRACE_S)
                    if gone:
                        raise BackendError(f"tensor-parallel rank {gone[0]} exited with code {gone[1]}")
                    raise BackendError(f"tensor-parallel rank {rank} failed: {detail}")
                results[rank] = detail
                continue
            gone = self.dead()
            if gone:
                raise BackendError(f"tensor-parallel rank {gone[0]} exited with code {gone[1]}")
            if deadline is not None and time.monotonic() > deadline:
                raise BackendError(f"tensor-parallel workers did not answer within {timeout:g} s")
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        try:
            self._send(("stop",), timeout=1.0)
        except (zmq.ZMQError, BackendError):
            pass
        stuck = self.dead() is not None  # the others may wait in a collective forever
        for proc in self._procs:
            try:
                proc.wait(timeout=1 if stuck else 10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sender in self._senders:
            sender.close()
        self._replies.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


class RankSample:
    """A step launched on worker ranks (``Executor.launch``), seen from the engine: each rank
    keeps its own sample on its device under ``step`` (the next step's ids are fed from it
    there); ``result`` reads rank 0's tokens."""

    def __init__(self, executor: Executor, step: int) -> None:
        self.executor, self.step = executor, step
        self._output: SampleOutput | None = None

    def feed(self, ids: Any, dest: Any, src: Any) -> Any:
        raise BackendError("a step launched on worker ranks feeds its tokens on the ranks, not in the engine")

    def result(self) -> SampleOutput:
        if self._output is None:
            self._output = self.executor._everywhere("collect", self.step)
        return self._output


class Executor:
    """The engine's handle on the model across ranks: a local runner, or worker processes."""

    def __init__(self, block_size: int, eos_token_ids: frozenset[int], runner: ModelRunner | None = None,
                 workers: Workers | None = None) -> None:
        assert (runner is None) != (workers is None)
        self.block_size = block_size
        self.eos_token_ids = np.array(sorted(eos_token_ids), dtype=np.int64)
        self.runner = runner
        self.workers = workers
        self._steps = itertools.count()  # ids of steps launched on worker ranks
        self._can_launch: bool | None = None
        self._rows = BlockTableRows()  # the running sequences' block tables, kept between steps
        self._round = 1  # the most steps a launch has queued at once (worker ranks keep two rounds' samples)

    def _all_ranks(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank's runner; their results, by rank."""
        if self.runner is not None:
            return [getattr(self.runner, method)(*args)]
        gone = self.workers.dead()
        if gone:
            raise BackendError(f"tensor-parallel rank {gone[0]} exited with code {gone[1]}")
        self.workers.call(method, *args)
        return self.workers.wait()

    def _everywhere(self, method: str, *args: Any) -> Any:
        """Call ``method`` on every rank's runner; rank 0's result."""
        return self._all_ranks(method, *args)[0]

    def memory_info(self) -> tuple[int, int]:
        """Rank 0's ``(free, total)`` device memory (the ranks are alike)."""
        return self._everywhere("memory_info")

    def profile_memory(self, num_tokens: int, num_rows: int, max_model_len: int, dtype: str) -> list[tuple[int, int, int]]:
        """Every rank's ``(free, total, peak)`` after a profiling step (ModelRunner.profile_memory)."""
        return self._all_ranks("profile_memory", num_tokens, num_rows, max_model_len, dtype)

    def sample_lacks(self, since: str) -> str:
        """Why the sample ops cannot do what contract ``since`` added to them ("" if they can)."""
        return self._everywhere("sample_lacks", since)

    def initialize_kv_cache(self, num_blocks: int, dtype: str) -> None:
        self._everywhere("initialize_kv_cache", num_blocks, dtype)

    def initialize_swap_space(self, num_blocks: int, dtype: str) -> None:
        self._everywhere("initialize_swap_space", num_blocks, dtype)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._everywhere("swap_out", pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._everywhere("swap_in", pairs)

    def export_kv(self, block_ids: list[int], on_device: bool = False) -> list[list[Any]]:
        """The keys and values of ``block_ids`` as host arrays (or device tensors), by rank
        (ModelRunner.export_kv). Device tensors do not cross to ranks of other processes."""
        if on_device:
            if self.runner is None:
                raise BackendError("a device KV transfer needs the engine's ranks in its own process")
            return [self.runner.export_kv(block_ids, on_device=True)]
        return self._all_ranks("export_kv", block_ids)

    def import_kv(self, block_ids: list[int], first: int, per_rank: list[list[np.ndarray]]) -> None:
        """Write transferred blocks ``first, first + 1, ...`` of each rank's arrays into
        ``block_ids`` (every rank takes its own: ``_worker``)."""
        if len(per_rank) != (1 if self.runner is not None else self.workers.world_size):
            raise BackendError(f"transferred keys and values of {len(per_rank)} ranks for an engine of another "
                               f"tensor-parallel size")
        if self.runner is not None:
            self.runner.import_kv(block_ids, first, per_rank[0])
        else:
            self._everywhere("import_kv", block_ids, first, per_rank)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._everywhere("copy_blocks", pairs)

    def pads_drafts(self) -> bool:
        return self._everywhere("pads_drafts")

    def propose(self, plan: ProposalPlan) -> np.ndarray:
        """Run the speculative proposer's model on every rank; rank 0's drafts."""
        return self._everywhere("propose", plan)

    def scores_lack(self) -> str:
        """Why the engine cannot score prompt tokens (prompt_logprobs; "" if it can)."""
        return self._everywhere("scores_lack")

    def _step_inputs(self, scheduled: list[ScheduledSeq], score: bool
                     ) -> tuple[StepInputs, list[Sequence], SamplingBatch | None, Scored]:
        inputs, sampled = prepare_inputs(scheduled, self.block_size, self._rows)
        scored = inputs.score_prompts(scheduled) if score else []
        batch = sampling_batch(sampled, self.eos_token_ids, drafts_ahead(scheduled)) if sampled else None
        return inputs, sampled, batch, scored

    def execute(self, scheduled: list[ScheduledSeq], fill: Fill | None = None, score: bool = False) -> StepResult:
        """Run a step and read its tokens. ``fill(sampled, batch)`` completes the sampling
        parameters (structured output's bitmask): here while the forward runs, before the
        step is sent where the ranks are processes of their own. ``score``: some sequence may
        owe prompt logprobs (the steps of others look for none)."""
        inputs, sampled, batch, scored = self._step_inputs(scheduled, score)
        if self.runner is not None:
            before = None if fill is None or batch is None else (lambda b: fill(sampled, b))
            output, prompt = self.runner.step(inputs, batch, before)
        else:
            if fill is not None and batch is not None:
                fill(sampled, batch)
            output, prompt = self._everywhere("step", inputs, batch)
        return StepResult(sampled, output if sampled else None, scored, prompt)

    @property
    def can_launch(self) -> bool:
        """Whether a step can be queued without waiting for its tokens: the ranks' op tables
        have ``sample_async``."""
        if self._can_launch is None:
            self._can_launch = bool(self._everywhere("can_launch"))
        return self._can_launch

    @property
    def can_defer(self) -> bool:
        """Whether a launched step's bitmask can be filled after its sample is queued (the op
        table's ``deferred_bitmask``; the mask lives in this process, so one rank here)."""
        return self.runner is not None and self.can_launch and self.runner.ops.has("deferred_bitmask")

    def deferred_bitmask(self, rows: int, words: int) -> DeferredBitmask:
        return self.runner.ops.deferred_bitmask(rows, words)

    def launch(self, scheduled: list[ScheduledSeq], previous: Launched | None, fill: Fill | None = None,
               score: bool = False, steps: int = 1) -> list[Launched]:
        """Queue a step on the device and return before its tokens are read (``can_launch``).
        Input tokens still marked ``PLACEHOLDER`` on the host are taken on the device from
        ``previous``, the step launched just before, whose tokens the host has not read yet.
        ``fill`` and ``score`` as ``execute``'s, ``fill`` called once the forward is queued.
        ``steps`` > 1: a round of decode steps (engine/rounds.py), each fed from the one
        before; one Launched per step, in order."""
        inputs, sampled, batch, scored = self._step_inputs(scheduled, score)
        feed = None
        dest = np.flatnonzero(inputs.input_ids == PLACEHOLDER)
        if dest.size:
            owners = np.searchsorted(inputs.meta.query_start_loc, dest, side="right") - 1
            src = np.fromiter((previous.rows[scheduled[i].seq.seq_id] for i in owners.tolist()),
                              dtype=np.int64, count=dest.size)
            feed = Feed(previous.pending, dest, src)
        rows = {s.seq_id: row for row, s in enumerate(sampled)}
        self._round = max(self._round, steps)
        launched = [self._launch(inputs, sampled, batch, feed, fill, rows, scored)]
        every = np.arange(len(sampled), dtype=np.int64)  # a round's rows: one per sequence, in order
        for j in range(1, steps):
            step_batch = later_batch(batch, j)
            # the forward's replacement may advance its last step on the device: no inputs to build
            pending = self.runner.advance(step_batch) if self.runner is not None else None
            if pending is not None:
                launched.append(Launched(sampled, pending, rows, [], None))
                continue
            feed = Feed(launched[-1].pending, every, every)
            launched.append(self._launch(later_inputs(inputs, j, self.block_size), sampled, step_batch, feed, None,
                                         rows, []))
        return launched

    def _launch(self, inputs: StepInputs, sampled: list[Sequence], batch: SamplingBatch | None, feed: Feed | None,
                fill: Fill | None, rows: dict[int, int], scored: Scored) -> Launched:
        if self.runner is not None:
            before = None if fill is None or batch is None else (lambda b: fill(sampled, b))
            pending, prompt = self.runner.launch(inputs, batch, feed, before)
            return Launched(sampled, pending, rows, scored, prompt)
        # Worker ranks: the bitmask is filled before the step is sent, as execute's. The feed
        # names the previous step; each rank takes its ids from its own sample of it. A rank
        # keeps the samples of the last two rounds: the engine reads a round after queuing the next.
        if fill is not None and batch is not None:
            fill(sampled, batch)
        step = next(self._steps)
        source = None if feed is None else (feed.tokens.step, feed.dest, feed.src)  # type: ignore[attr-defined]
        sampling, prompt = self._everywhere("launch", step, inputs, batch, source, 2 * self._round)
        return Launched(sampled, RankSample(self, step) if sampling else None, rows, scored, prompt)

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


# -- the worker process --------------------------------------------------------------------------


# a rank's calls that build what lasts the process (its KV cache, graphs, swap space): frozen
# out of the garbage collector's full collections once done (fd_core.heap)
_SET_UP = frozenset({"initialize_kv_cache", "initialize_swap_space"})


def _worker(rank: int, calls: str, replies: str) -> int:
    from fd_core.engine.loading import load_runner
    from fd_core.plugins import get_registry

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(calls)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(replies)

    def answer(ok: bool, detail: Any = None) -> None:
        outbox.send(pickle.dumps((rank, ok, detail), protocol=pickle.HIGHEST_PROTOCOL))

    runner = None
    # this rank's samples of launched steps, by step id: the next step feeds from the last one
    # and the engine reads rank 0's after queuing that next step (Executor.launch)
    kept: dict[int, Any] = {}
    try:
        while True:
            message = pickle.loads(inbox.recv())
            if message[0] == "stop":
                return 0
            try:
                if message[0] == "init":
                    _, config, world_size, rendezvous = message
                    registry = get_registry()
                    platform = registry.platform(config.device, config.runtime)  # the engine's runtime
                    comm = platform.communicator(rank, world_size, rendezvous)
                    runner = load_runner(config, platform, registry, rank, world_size, comm)
                    result = None
                else:
                    _, method, args = message
                    if method == "step" and rank != 0:
                        args = (args[0], None, None, False)  # rank 0 samples and scores; the others only compute
                    elif method == "import_kv":
                        args = (args[0], args[1], args[2][rank])  # each rank its own heads
                    if method == "launch":
                        result = _launch(runner, kept, rank, *args)
                    elif method == "collect":
                        # rank 0's tokens; the sample stays kept while the step after may feed from it
                        result = kept[args[0]].result() if rank == 0 else None
                    else:
                        result = getattr(runner, method)(*args)
            except Exception as exc:  # reported to rank 0, which stops the engine
                log.exception("tensor-parallel rank %d failed", rank)
                answer(False, f"{type(exc).__name__}: {exc}" if isinstance(exc, FdError) else repr(exc))
                return 1
            if message[0] == "init" or message[1] in _SET_UP:
                freeze_startup_heap()
            answer(True, result)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _launch(runner: ModelRunner, kept: dict[int, Any], rank: int, step: int, inputs: StepInputs,
            batch: SamplingBatch | None, source: tuple[int, np.ndarray, np.ndarray] | None, keep: int = 2
            ) -> tuple[bool, SampleOutput | None]:
    """One rank's part of ``Executor.launch``: whether the step samples, and (rank 0) the
    prompt scores. Every rank samples, so each can feed the next step from its own device.
    ``keep``: how many of the latest samples the engine may still read (this one included)."""
    feed = None
    if source is not None:
        previous, dest, src = source
        feed = Feed(kept[previous], dest, src)
    pending, prompt = runner.launch(inputs, batch, feed, lead=rank == 0)
    for old in [s for s in kept if s <= step - keep]:  # read by the engine: no later step feeds from them
        del kept[old]
    if pending is not None:
        kept[step] = pending
    return pending is not None, prompt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="one tensor-parallel rank of an fd engine (started by rank 0)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--calls", required=True)
    ap.add_argument("--replies", required=True)
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--log-level", default=None, help="the engine's (a name or a number; default: $FD_LOG_LEVEL)")
    args = ap.parse_args(argv)
    configure(rank_level(parse_level(args.log_level), args.rank), role=f"rank{args.rank}")
    watch_parent(args.parent)
    return _worker(args.rank, args.calls, args.replies)


if __name__ == "__main__":
    sys.exit(main())
