"""Requests in flight between the HTTP handlers and the engine client.

Each engine request is read by its own task (a *pump*) that keeps only the newest output:
outputs are cumulative, so a slow HTTP reader skips intermediate ones and loses nothing, and
the engine never waits on a socket. The handler reads from the pump, never from the engine,
which lets the monitor end every reader at once when the engine dies, whatever the client
library does, and lets a disconnect cancel the pump (closing the engine's iterator aborts the
request in the core and frees its KV blocks).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fd_core.engine.outputs import RequestOutput
from fd_core.engine.sampling_params import SamplingParams

from fd_server.errors import EngineDeadError

log = logging.getLogger("fd_server")


class EngineMonitor:
    """Engine health as the server sees it, the requests in flight, and the concurrency limit.

    Two kinds of trouble: a *dead* engine (its process is gone: the server fails everything and
    exits, see ``fd_server.app``) and a *stalled* one (alive, but it has not reported — a step
    or an idle heartbeat — for ``heartbeat_timeout`` seconds: frozen, swapping, stuck in a
    step). A stalled engine is not serving: /health and new requests get 503 until it reports
    again; requests in flight wait for it, bounded by the request timeout."""

    def __init__(self, client: Any, max_concurrency: int | None = None,
                 on_finished: Callable[["RequestStream"], None] | None = None,
                 heartbeat_timeout: float | None = None,
                 on_output: Callable[[RequestStream, RequestOutput, bool], None] | None = None) -> None:
        self.client = client
        self.max_concurrency = max_concurrency
        self.on_finished = on_finished  # a request finished normally
        self.on_output = on_output  # each output of a request, and whether it brought its first token
        self.heartbeat_timeout = heartbeat_timeout or None
        self.dead = asyncio.Event()
        self.dead_reason = ""
        self.streams: set[RequestStream] = set()
        self.in_flight = 0
        self._background: set[asyncio.Task] = set()
        self._stalled = False

    # -- health ------------------------------------------------------------------------------

    def alive(self) -> bool:
        if self.dead.is_set():
            return False
        try:
            return bool(self.client.is_healthy())
        except Exception:  # a client that cannot even answer is not healthy
            log.exception("engine client is_healthy() raised")
            return False

    def silent_for(self) -> float:
        """Seconds since the engine core last reported (0 for a client that does not say)."""
        age = getattr(self.client, "report_age", None)
        return age() if age is not None else 0.0

    def healthy(self) -> bool:
        """Serving: alive, reporting, and (a client may say why not, e.g. a router with no
        instance left: ``client.cannot_serve()``) able to take requests."""
        if not self.alive():
            return False
        if self._client_unavailable():
            return False
        stalled = self.heartbeat_timeout is not None and self.silent_for() > self.heartbeat_timeout
        if stalled != self._stalled:
            self._stalled = stalled
            if stalled:
                log.error("the engine core has not reported for %.1f s (--heartbeat-timeout %g); /health is 503 "
                          "until it does", self.silent_for(), self.heartbeat_timeout)
            else:
                log.warning("the engine core reports again; serving")
        return not stalled

    def _client_unavailable(self) -> str | None:
        cannot_serve = getattr(self.client, "cannot_serve", None)
        return cannot_serve() if cannot_serve is not None else None

    def unavailable_reason(self) -> str:
        if not self.alive():
            return self.dead_reason
        reason = self._client_unavailable()
        if reason:
            return reason
        return (f"the engine core has not reported for {self.silent_for():.0f} s "
                f"(stalled; --heartbeat-timeout {self.heartbeat_timeout:g})")

    def mark_dead(self, reason: str) -> None:
        """The engine is gone: fail every request in flight now; later ones get 503."""
        if self.dead.is_set():
            return
        self.dead_reason = reason or "the engine-core process stopped"
        log.error("engine is dead (%s); failing %d request(s) in flight", self.dead_reason, len(self.streams))
        self.dead.set()
        for stream in list(self.streams):
            stream.fail(EngineDeadError(self.dead_reason))

    async def watch(self, interval: float = 0.1) -> None:
        """Poll the client's health so a dead engine is noticed even with nothing in flight."""
        while not self.dead.is_set():
            if not self.alive():
                self.mark_dead("the engine-core process stopped")
                return
            self.healthy()  # logs a stall as it begins and ends
            await asyncio.sleep(interval)

    # -- admission ---------------------------------------------------------------------------

    def admit(self) -> bool:
        """Take a slot for one HTTP request; False when ``max_concurrency`` are in flight."""
        if self.max_concurrency is not None and self.in_flight >= self.max_concurrency:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        self.in_flight -= 1

    # -- requests ----------------------------------------------------------------------------

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             prompt_text: str | None, notify: asyncio.Event, arrival: float,
             cache_salt: str | None = None) -> "RequestStream":
        stream = RequestStream(self, request_id, prompt_token_ids, params, prompt_text, notify, arrival,
                               cache_salt)
        self.streams.add(stream)
        return stream

    def spawn(self, coro: Any) -> None:
        """Run a fire-and-forget coroutine, keeping a reference until it ends."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class RequestStream:
    """One engine request, read by a pump task; the handler reads ``latest``."""

    def __init__(self, monitor: EngineMonitor, request_id: str, prompt_token_ids: list[int],
                 params: SamplingParams, prompt_text: str | None, notify: asyncio.Event,
                 arrival: float, cache_salt: str | None = None) -> None:
        self.monitor = monitor
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.prompt_text = prompt_text
        self.cache_salt = cache_salt
        self.notify = notify
        self.arrival = arrival
        # time.monotonic(): when the engine client received the first and the last token (when
        # the pump did, for a client that does not time its outputs)
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.done = False
        self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        client = self.monitor.client
        try:
            last_token_at = None
            async for output in client.generate(self.request_id, self.prompt_token_ids, self.params,
                                                prompt_text=self.prompt_text, cache_salt=self.cache_salt):
                m = output.metrics
                last_token_at = m.last_token_time if m is not None else time.monotonic()
                first = self.first_token_at is None and any(o.token_ids for o in output.outputs)
                if first:
                    self.first_token_at = m.first_token_time if m is not None else last_token_at
                self.latest = output
                self._report(self.monitor.on_output, output, first)
                self.notify.set()
            if self.latest is None or not self.latest.finished:
                raise RuntimeError(f"the engine ended request {self.request_id} without finishing it")
            self.finished_at = last_token_at
            self._report(self.monitor.on_finished)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as exc:
            self.error = exc
            self.monitor.mark_dead(str(exc))
        except Exception as exc:
            self.error = exc
        finally:
            self.done = True
            self.monitor.streams.discard(self)
            self.notify.set()

    def _report(self, callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(self, *args)
        except Exception:  # metrics must never fail a request that succeeded
            log.exception("recording metrics for %s failed", self.request_id)

    def fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.error = exc
        self.done = True
        self.notify.set()
        self._task.cancel()

    def close(self) -> None:
        """Stop following the request; abort it in the engine unless it already finished.

        Synchronous on purpose: it is called from ``finally`` blocks of cancelled tasks, where
        an ``await`` would itself be cancelled."""
        self.monitor.streams.discard(self)
        finished = self.latest is not None and self.latest.finished
        if not self._task.done():
            self._task.cancel()  # closes the engine's iterator, which aborts in the core
        if not finished and not self.monitor.dead.is_set():
            self.monitor.spawn(self._abort())

    async def _abort(self) -> None:
        try:
            await self.monitor.client.abort(self.request_id)
        except Exception as exc:  # already gone, or the engine died meanwhile
            log.debug("abort of %s: %s", self.request_id, exc)


async def follow(streams: list[RequestStream], notify: asyncio.Event) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
    """Yield, each time something changed, the ``(position, newest output)`` of the changed
    streams; raise the first error; end when all are finished."""
    seen: list[RequestOutput | None] = [None] * len(streams)
    while True:
        await notify.wait()
        notify.clear()
        for stream in streams:
            if stream.error is not None:
                raise stream.error
        # read before the outputs: a pump sets its last output before it marks itself done
        finished = all(s.done for s in streams)
        changed = []
        for i, stream in enumerate(streams):
            if stream.latest is not None and stream.latest is not seen[i]:
                seen[i] = stream.latest
                changed.append((i, stream.latest))
        if changed:
            yield changed
        if finished:
            return
