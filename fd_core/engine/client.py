"""AsyncEngineClient: the HTTP process's handle on the engine-core process.

The core process (``core_process``) computes token ids; this side owns the tokenizer and the
OutputProcessor (detokenization, stop strings), so text work never competes with the model for
the core's GIL. One asyncio task reads the core's messages and routes each step's outputs to the
``generate`` calls waiting on them; another watches the process, so a dead core fails every
caller at once instead of leaving it waiting.

Requests get a fresh id on the wire: outputs of an aborted request still in flight can then
never be mistaken for a later request that reuses its id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from fd_core import errors
from fd_core.cluster.config import REDIS_CALL_TIMEOUT_S, REDIS_POLL_S, SchedulerConfig
from fd_core.engine.config import EngineConfig
from fd_core.engine.core import (
    CoreOutput,
    PromptLogprobs,
    check_cache_salt,
    check_params,
    check_prompt,
)
from fd_core.engine.core_handle import CoreHandle, CoreWatch, await_ready, client_addresses
from fd_core.engine.output_processor import OutputProcessor
from fd_core.engine.outputs import RequestOutput
from fd_core.engine.prompts import token_id_list
from fd_core.engine.sampling_params import SamplingParams
from fd_core.engine.wire import (
    Abort,
    AddRequest,
    ClientMessage,
    CoreMessage,
    Failed,
    Ready,
    Stats,
    StepOutputs,
    params_to_wire,
    wire_id,
)
from fd_core.errors import BackendError, EngineDeadError, InvalidRequestError
from fd_core.loader.tokenizer_api import Tokenizer

log = logging.getLogger("fd.engine")

_WATCH_S = 0.1  # how often the process is checked for life
_SHUTDOWN_GRACE_S = 5.0  # a core that has not exited this long after Shutdown is terminated


@dataclass
class _Stream:
    """One ``generate`` call: what the reader task has for it, in order."""

    request_id: str
    wire_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestOutput | Exception
    done: bool = False


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, scheduler: SchedulerConfig | None = None,
                 addresses: tuple[str, str] | None = None, index: int = 0, clients: int = 1) -> None:
        # use ``await AsyncEngineClient.start(config)`` (or ``attach``); this only sets the fields
        self.config = config
        # --scheduler-name global: requests go to this instance's queue in Redis (other
        # instances may steal them) and their outputs come back through it
        self.scheduler = scheduler if scheduler is not None and scheduler.is_global else None
        self._cluster = None  # GlobalScheduler, once started
        self._cluster_reader = None
        self._origin = ""
        self.tokenizer: Tokenizer | None = None  # loaded in this process, for the front end
        # from the core's Ready message: the model's and the resolved engine's figures
        self.max_model_len = 0
        self.vocab_size = 0
        self.max_num_batched_tokens = 0
        self.chunked_prefill = True
        self.unavailable: dict[str, str] = {}  # from the core's Ready
        self.eos_token_ids: frozenset[int] = frozenset()
        self._core: CoreHandle | CoreWatch | None = None  # a handle where this client spawned the core
        self._index, self._clients = index, clients  # this client among the core's clients
        self._dir = tempfile.mkdtemp(prefix="fd-") if addresses is None else None
        self._in_address, self._out_address = addresses or client_addresses(self._dir, 0)
        self._ctx = zmq.asyncio.Context()
        # Sends are synchronous and never block (no high-water mark), so an abort can go out
        # from a generator's ``finally`` even while it is being closed or cancelled.
        self._sender = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._sender.setsockopt(zmq.SNDHWM, 0)
        self._sender.setsockopt(zmq.LINGER, 0)
        self._sender.bind(self._in_address)
        self._receiver = self._ctx.socket(zmq.PULL)
        self._receiver.setsockopt(zmq.LINGER, 0)
        self._receiver.bind(self._out_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(CoreMessage)
        self._processor: OutputProcessor | None = None
        self._streams: dict[str, _Stream] = {}  # by the caller's request id
        self._by_wire_id: dict[str, _Stream] = {}
        self._wire_ids = itertools.count()
        self._stats = Stats()
        self._last_report = time.monotonic()  # when the core last sent anything (steps, heartbeats)
        self._dead_reason: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._core_failed = False  # the core reported a start-up error and is exiting

    # -- start-up --------------------------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig, start_timeout: float = 900.0,
                    scheduler: SchedulerConfig | None = None) -> "AsyncEngineClient":
        """Spawn the engine-core process and wait until its model is loaded.

        A start-up failure in the core is raised here as the same fd error type with the core's
        message; a core that is not ready within ``start_timeout`` seconds raises BackendError.
        With ``scheduler`` global, a Redis that cannot be reached stops it first
        (SchedulerUnavailableError, naming the host and port).
        """
        self = cls(config, scheduler)
        if self.scheduler is not None:
            from fd_core.cluster.global_scheduler import GlobalScheduler, connect

            self.scheduler = self.scheduler.started()
            self._origin = self.scheduler.instance_id
            self._cluster = GlobalScheduler(connect(self.scheduler.address, timeout=REDIS_CALL_TIMEOUT_S),
                                            self.scheduler.topic, None, self.scheduler.ttl, self.scheduler.role)
            # the outputs' blocking reads get a connection of their own, whose reads may take
            # longer than one wait
            self._cluster_reader = GlobalScheduler(connect(self.scheduler.address, timeout=REDIS_POLL_S + 1.0),
                                                   self.scheduler.topic, None, self.scheduler.ttl,
                                                   self.scheduler.role)
        try:
            self._core = CoreHandle.spawn(config, [(self._in_address, self._out_address)], self.scheduler)
            ready = await self._ready_with_tokenizer(start_timeout)
        except BaseException:
            # a core that reported its failure exits by itself; any other one is stopped now
            if self._core is not None:
                await self._core.stop(ask=False, grace=2.0 if self._core_failed else 0.0)
            self._close_sockets()
            raise
        self._running(ready)
        return self

    @classmethod
    async def attach(cls, config: EngineConfig, addresses: tuple[str, str], core_pid: int, index: int,
                     clients: int, start_timeout: float = 900.0) -> "AsyncEngineClient":
        """A client of a core another process spawned (``CoreHandle.spawn``) for ``clients``
        clients, of which this is number ``index``, its sockets at ``addresses``. Waits until the
        core is ready; its shutdown leaves the core to its owner."""
        self = cls(config, None, addresses, index, clients)
        self._core = CoreWatch(core_pid)
        try:
            ready = await self._ready_with_tokenizer(start_timeout)
        except BaseException:
            self._close_sockets()
            raise
        self._running(ready)
        return self

    async def _ready_with_tokenizer(self, timeout: float) -> Ready:
        # the tokenizer loads here while the core loads the model
        tokenizer = asyncio.create_task(asyncio.to_thread(self._load_tokenizer))
        try:
            ready = await self._wait_ready(timeout)
        except BaseException:
            tokenizer.cancel()  # the core's error is the one to report
            raise
        self.tokenizer = await tokenizer
        return ready

    def _running(self, ready: Ready) -> None:
        self._take_ready(ready)
        self._stats = Stats(num_free_blocks=ready.num_blocks, num_blocks=ready.num_blocks)
        self._last_report = time.monotonic()
        self._tasks = [asyncio.create_task(self._read_loop(), name="fd-engine-reader"),
                       asyncio.create_task(self._watch_loop(), name="fd-engine-watch")]
        if self._cluster is not None:
            self._tasks.append(asyncio.create_task(self._cluster_loop(), name="fd-cluster-reader"))
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)

    def _take_ready(self, ready: Ready) -> None:
        """The engine's figures, and the output processor on the tokenizer loaded by now."""
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = frozenset(ready.eos_token_ids)
        self.max_num_batched_tokens = ready.max_num_batched_tokens
        self.chunked_prefill = ready.chunked_prefill
        self.unavailable = ready.unavailable
        self._processor = OutputProcessor(self.tokenizer)

    def _load_tokenizer(self):
        from fd_core.engine.loading import open_checkpoint

        return open_checkpoint(self.config).tokenizer

    async def _wait_ready(self, timeout: float) -> Ready:
        async def next_message() -> CoreMessage | None:
            if not await self._receiver.poll(int(_WATCH_S * 1000)):
                return None
            msg = self._decoder.decode(await self._receiver.recv())
            if isinstance(msg, Failed):
                self._core_failed = True
            return msg

        return await await_ready(next_message, self._core, timeout)

    # -- state -----------------------------------------------------------------------------

    def is_healthy(self) -> bool:
        return self._dead_reason is None and self._core is not None and self._core.is_alive()

    def check_prompt(self, token_ids: list[int]) -> None:
        """Raise InvalidRequestError / PromptTooLongError for a prompt the core would reject."""
        check_prompt(token_ids, self.vocab_size, self.max_model_len, self.max_num_batched_tokens,
                     self.chunked_prefill)

    def check_params(self, params: SamplingParams) -> None:
        """The core's parameter check, run here so the HTTP layer can answer 400 up front."""
        check_params(params, self.vocab_size, self.config.max_logprobs, self.unavailable)

    def report_age(self) -> float:
        """Seconds since the core last reported: it does after every step and, when idle, every
        ``core_process.HEARTBEAT_S``, so a long silence means it is frozen or stuck."""
        return time.monotonic() - self._last_report

    def metrics(self) -> dict:
        """The core's latest stats, and how old they are (``report_age_seconds``)."""
        return {**msgspec.structs.asdict(self._stats), "report_age_seconds": self.report_age()}

    # -- requests --------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       prompt_text: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it; the last one
        has ``finished=True``. Stopping early (break, cancellation) aborts it in the core.

        ``cache_salt`` (a non-empty string) keeps the request's prefix-cache entries apart:
        only requests with the same salt share cached prompt blocks. ``num_cached_tokens`` of
        the outputs says how many prompt tokens the prefix cache supplied."""
        self._raise_if_dead()
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        token_ids = token_id_list(prompt_token_ids)
        # in a cluster the id travels through Redis beside other instances' requests
        number = next(self._wire_ids)
        stream = _Stream(request_id, f"{self._origin}:{number}" if self._cluster is not None
                         else wire_id(number, self._index, self._clients))
        self._streams[request_id] = stream
        self._by_wire_id[stream.wire_id] = stream
        self._processor.add_request(request_id, prompt_text, token_ids, params)
        try:
            self._send(AddRequest(stream.wire_id, token_ids, params_to_wire(params), cache_salt))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.done:  # the caller left early, or an error came
                self._forget(stream, abort_in_core=True)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its ``generate`` ends with a last output whose reason is ``abort``."""
        stream = self._streams.get(request_id)
        if stream is None or stream.done:
            return
        last = self._forget(stream, abort_in_core=True)
        if last is not None:
            stream.queue.put_nowait(last)

    def _forget(self, stream: _Stream, abort_in_core: bool) -> RequestOutput | None:
        stream.done = True
        self._streams.pop(stream.request_id, None)
        self._by_wire_id.pop(stream.wire_id, None)
        if abort_in_core and self._dead_reason is None:
            self._send(Abort(stream.wire_id), quiet=True)
        return self._processor.abort(stream.request_id)

    def _send(self, msg: ClientMessage, quiet: bool = False) -> None:
        if self._cluster is not None and isinstance(msg, (AddRequest, Abort)):
            self._send_to_cluster(msg, quiet)
            return
        try:
            self._sender.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the core is gone (no peer) or the client is closed
            if not quiet:
                raise EngineDeadError(f"the engine core cannot be reached ({e})") from None

    def _send_to_cluster(self, msg: AddRequest | Abort, quiet: bool) -> None:
        import redis

        from fd_core.cluster.instance import abort_key

        try:
            if isinstance(msg, AddRequest):
                self._submit(msg)
            else:
                self._cluster.abort(msg.request_id, abort_key(msg.request_id, msg.index))
        except redis.RedisError as exc:
            if not quiet:
                raise errors.SchedulerUnavailableError(
                    f"the global scheduler's Redis at {self.scheduler.address} is unreachable; the request was "
                    f"not queued ({exc})") from None
            log.warning("could not pass an abort to the global scheduler's Redis at %s: %s",
                        self.scheduler.address, exc)

    def _submit(self, msg: AddRequest) -> None:
        # this instance's own queue: an idle instance steals from it (FastDeploy's way); a
        # decode instance takes no prompts: a prefill instance's queue
        target = self._cluster.choose("prefill") if self.scheduler.role == "decode" else self._origin
        self._cluster.submit(target, self._origin, msg.request_id, self._encoder.encode(msg), len(msg.token_ids))

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._processor is None:
            raise EngineDeadError("the engine client was not started; use AsyncEngineClient.start")

    # -- background tasks ------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            msg = self._decoder.decode(await self._receiver.recv())
            self._last_report = time.monotonic()
            if isinstance(msg, StepOutputs):
                self._stats = msg.stats
                if msg.outputs:
                    self._on_outputs(msg.outputs, self._last_report)
            elif isinstance(msg, Failed):
                if msg.request_id is None:
                    self._die(f"the engine core failed: {msg.error_type}: {msg.message}")
                    return
                stream = self._by_wire_id.get(msg.request_id)
                if stream is not None:
                    self._forget(stream, abort_in_core=False)
                    stream.queue.put_nowait(errors.rebuild(msg.error_type, msg.message, BackendError))

    async def _cluster_loop(self) -> None:
        """Outputs of this instance's requests, from whichever instance ran them."""
        import redis

        down_since = None
        while True:
            try:
                batches = await asyncio.to_thread(self._cluster_reader.results, self._origin, REDIS_POLL_S)
            except redis.RedisError as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.error("the global scheduler's Redis at %s is unreachable (%s); new requests are refused "
                              "until it answers", self.scheduler.address, exc)
                await asyncio.sleep(REDIS_POLL_S)
                continue
            if down_since is not None:
                log.warning("the global scheduler's Redis at %s answers again", self.scheduler.address)
                down_since = None
            received = time.monotonic()
            for raw in batches:
                msg = self._decoder.decode(raw)
                if isinstance(msg, StepOutputs):
                    self._on_outputs(msg.outputs, received)
                elif isinstance(msg, Failed) and msg.request_id is not None:
                    stream = self._by_wire_id.get(msg.request_id)
                    if stream is not None:
                        self._forget(stream, abort_in_core=False)
                        stream.queue.put_nowait(errors.rebuild(msg.error_type, msg.message, BackendError))

    def _on_outputs(self, wire_outputs, received: float) -> None:
        outputs = []
        for w in wire_outputs:
            stream = self._by_wire_id.get(w.request_id)
            if stream is not None:  # else it was aborted here while the core computed it
                outputs.append(CoreOutput(stream.request_id, w.index, w.token_ids, w.logprob, w.logprobs,
                                          w.ranks, w.top, w.finish_reason, w.stop_reason, w.num_cached_tokens,
                                          w.time_in_queue, w.prefill_time,
                                          None if w.prompt_logprobs is None else PromptLogprobs(*w.prompt_logprobs)))
        results, stopped = self._processor.process(outputs, now=received)
        for request_id, index in stopped:  # stop strings end sequences on this side
            self._send(Abort(self._streams[request_id].wire_id, index), quiet=True)
        for result in results:
            stream = self._streams[result.request_id]
            if result.finished:
                stream.done = True
                self._streams.pop(stream.request_id, None)
                self._by_wire_id.pop(stream.wire_id, None)
            stream.queue.put_nowait(result)

    async def _watch_loop(self) -> None:
        while self._core.is_alive():
            await asyncio.sleep(_WATCH_S)
        self._die(f"the engine core process exited (code {self._core.exitcode})")

    def _on_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            # a bug on this side must not leave callers waiting for outputs that cannot come
            log.error("engine client task %s failed", task.get_name(), exc_info=task.exception())
            self._die(f"the engine client failed: {task.exception()!r}")

    def _die(self, reason: str) -> None:
        """Mark the engine dead and fail every request in flight with EngineDeadError."""
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        if not self._closed:
            log.error("%s", reason)
        for stream in list(self._streams.values()):
            self._forget(stream, abort_in_core=False)
            stream.queue.put_nowait(EngineDeadError(reason))

    # -- shutdown --------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop the core process where this client spawned it (asking first, then terminating,
        then killing) and fail any request still in flight. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._die("the engine was shut down")
        if isinstance(self._core, CoreHandle):
            await self._core.stop(ask=True, grace=_SHUTDOWN_GRACE_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._sender.close()
        self._receiver.close()
        with contextlib.suppress(zmq.ZMQError):
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
