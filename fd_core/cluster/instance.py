"""An engine core's side of the global scheduler: it pulls requests while it has room (its own
queue first, then stealing), reports its load, takes dead instances' queues over, and sends
each request's outputs to whoever submitted it. A prefill instance hands its requests on after
their first token, a decode instance takes them (``fd_core.cluster.disaggregation``).

Redis going away must not stop the requests already running: an error is logged once, the
outputs wait here (``MAX_PENDING`` at most) and go out when Redis answers again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from fd_core.cluster.config import SchedulerConfig
from fd_core.cluster.global_scheduler import GlobalScheduler, Load, connect
from fd_core.cluster.heartbeat import Heartbeat
from fd_core.cluster.role import Role
from fd_core.engine.wire import AddRequest, Failed, Stats, StepOutputs, WireOutput, params_from_wire

log = logging.getLogger("fd.cluster")

REAP_S = 1.0  # how often dead instances are looked for
REDIS_TIMEOUT_S = 0.5
MAX_PENDING = 100_000  # outputs kept for their submitters while Redis is unreachable


def abort_key(request_id: str, index: int | None) -> str:
    """An abort as the scheduler's abort list carries it: the request, or one of its sequences."""
    return request_id if index is None else f"{request_id}|{index}"


def parse_abort(key: str) -> tuple[str, int | None]:
    request_id, sep, index = key.rpartition("|")
    if sep and index.isdigit():
        return request_id, int(index)
    return key, None


class ClusterInbox:
    def __init__(self, config: SchedulerConfig, capacity: int, core: Any = None) -> None:
        """``core``: the engine, needed by a prefill or decode instance (its KV layout)."""
        self.config = config
        # short timeouts: a Redis that does not answer must not hold the engine's steps for long
        self.scheduler = GlobalScheduler(connect(config.address, timeout=REDIS_TIMEOUT_S), config.topic,
                                         config.instance_id, config.ttl, config.role)
        self.capacity = capacity
        self.role = Role() if config.role == "mixed" else self._disaggregate(core)
        self.heartbeat_s = min(0.5, config.ttl / 4)
        self.heartbeat = Heartbeat(GlobalScheduler(connect(config.address, timeout=REDIS_TIMEOUT_S), config.topic,
                                                   config.instance_id, config.ttl, config.role), self.heartbeat_s)
        self.served = 0
        self.origins: dict[str, str] = {}  # request id -> where its results go
        self._outputs: dict[str, list[WireOutput]] = {}  # by origin, not yet published
        self.failures: dict[str, list[Failed]] = {}  # by origin, not yet published
        self.finished: list[str] = []  # requests to forget in Redis
        self._retry_at = 0.0
        self._next_reap = 0.0
        self._down_since: float | None = None
        self._ready: bytes | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(AddRequest)

    def _disaggregate(self, core: Any) -> Role:
        from fd_core.cluster.disaggregation import TRANSFER_TIMEOUT_S, DecodeSide, PrefillSide, check_transfer
        from fd_core.plugins import get_registry
        from fd_core.runtimes.host import keep_freed_host_memory

        transfer = get_registry().kv_transfer(self.config.cache_transfer_protocol, TRANSFER_TIMEOUT_S)
        try:
            check_transfer(transfer, core, self.config.role)
        except Exception:
            transfer.close()
            raise
        keep_freed_host_memory()  # each request's KV blocks pass through host arrays of megabytes
        if self.config.role == "prefill":
            return PrefillSide(self.scheduler, transfer, core)
        return DecodeSide(self.scheduler, transfer, core, self.config)

    @property
    def transfer_stats(self):
        return self.role.stats

    def poll(self, core: Any) -> int:
        """Report, reap, apply aborts and pull requests into ``core`` while it has room; the
        number of requests and aborts taken."""
        import redis

        self.heartbeat.update(self._load(core))
        if self._down_since is not None and time.monotonic() < self._retry_at:
            return 0  # Redis was away a moment ago: try again a heartbeat later
        try:
            handled = self._poll(core)
            self.flush()
        except redis.RedisError as exc:
            self._lost(exc)
            return 0
        if self._down_since is not None:
            log.warning("the global scheduler's Redis at %s answers again (after %.1f s)", self.config.address,
                        time.monotonic() - self._down_since)
            self._down_since = None
        return handled

    def _poll(self, core: Any) -> int:
        now = time.monotonic()
        if self._down_since is not None and self._ready is not None:  # Redis may have lost it
            self.scheduler.announce(self._ready)
        self.heartbeat.start()
        if now >= self._next_reap:
            self.scheduler.reap(self._failure)
            self._next_reap = now + REAP_S
        handled = 0
        for key in self.scheduler.aborts():
            self.role.abort(core, *parse_abort(key))
            handled += 1
        handled += self.role.poll(core, self)
        self._forget_finished(core)
        if not self.role.takes_queue:
            return handled
        room = self.role.room(core, self.capacity - len(core.scheduler.running) - len(core.scheduler.waiting))
        for pulled in self.scheduler.pull(room):
            handled += 1
            try:
                msg = self._decoder.decode(pulled.payload)
                core.add_request(pulled.request_id, msg.token_ids, params_from_wire(msg.params), msg.cache_salt,
                                 hand_over=self.role.hand_over)
            except Exception as exc:  # noqa: BLE001 - this request only; the others go on
                self.failures.setdefault(pulled.origin, []).append(
                    Failed(type(exc).__name__, str(exc), pulled.request_id))
                self.finished.append(pulled.request_id)
                continue
            self.origins[pulled.request_id] = pulled.origin
            self.role.pulled(pulled.request_id, pulled.payload)
        return handled

    def publish(self, core: Any, outputs: list[WireOutput]) -> None:
        """Send a step's outputs to their submitters (or keep them while Redis is away)."""
        import redis

        for output in outputs:
            origin = self.origins.get(output.request_id)
            if origin is not None:
                self._outputs.setdefault(origin, []).append(output)
        try:
            self.role.stepped(core, self)
        except redis.RedisError as exc:
            self._lost(exc)
        self._forget_finished(core)
        pending = sum(map(len, self._outputs.values()))
        if pending > MAX_PENDING:
            raise RuntimeError(f"{pending} outputs could not reach the global scheduler's Redis at "
                               f"{self.config.address}; giving up")
        if self._down_since is not None and time.monotonic() < self._retry_at:
            return  # retried with the next poll
        try:
            self.flush()
        except redis.RedisError as exc:
            self._lost(exc)

    def leave(self) -> None:
        """A clean stop: the requests this engine still holds end with an error to their
        submitters, our queue goes to another instance, and we are no longer live."""
        import redis

        for request_id, origin in self.origins.items():
            self.failures.setdefault(origin, []).append(Failed(
                "SchedulerUnavailableError", f"the instance {self.config.instance_id} running this request was "
                                             f"stopped; the request was ended", request_id))
            self.finished.append(request_id)
        self.origins = {}
        self.heartbeat.stop()  # before leaving: a report after it would make us live again
        try:
            self.flush()
            self.scheduler.leave()
        except redis.RedisError as exc:
            log.warning("could not leave the global scheduler cleanly: %s", exc)
        self.role.close()

    def announce(self, ready: bytes) -> None:
        """Publish the engine's ``Ready`` for front ends (``fd router``); retried with the
        heartbeats while Redis is away."""
        import redis

        self._ready = ready
        try:
            self.scheduler.announce(ready)
        except redis.RedisError as exc:
            self._lost(exc)

    def _forget_finished(self, core: Any) -> None:
        done = [r for r in self.origins if r not in core.seqs]
        for request_id in done:
            del self.origins[request_id]
            self.role.forget(request_id)
        self.finished.extend(done)
        self.served += len(done)

    def flush(self) -> None:
        """Publish the outputs and failures kept for their submitters, and forget the finished
        requests in Redis. Raises redis.RedisError (they are kept for the next try)."""
        if self._outputs or self.failures:
            batches: dict[str, list[bytes]] = {}
            for origin, outputs in self._outputs.items():
                batches.setdefault(origin, []).append(self._encoder.encode(StepOutputs(outputs, Stats())))
            for origin, failures in self.failures.items():
                batches.setdefault(origin, []).extend(self._encoder.encode(f) for f in failures)
            self.scheduler.publish(batches)
            self._outputs, self.failures = {}, {}
        if self.finished:
            self.scheduler.finish(self.finished)
            self.finished = []

    def _failure(self, request_id: str, message: str) -> bytes:
        return self._encoder.encode(Failed("SchedulerUnavailableError", message, request_id))

    def _load(self, core: Any) -> Load:
        pool = core.pool
        load = Load(running=len(core.scheduler.running), waiting=len(core.scheduler.waiting),
                    free_blocks=pool.num_free, num_blocks=pool.capacity, capacity=self.capacity, served=self.served)
        self.role.report(load)
        return load

    def _lost(self, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.error("the global scheduler's Redis at %s is unreachable (%s); the requests running here go on, "
                      "their outputs wait until it answers", self.config.address, exc)
        self._retry_at = time.monotonic() + self.heartbeat_s
