"""``fd router``'s engine client: the HTTP front end of ``fd serve`` over every instance of a
cluster instead of one engine core of its own.

It tokenizes, detokenizes and parses as ``fd serve``'s HTTP process does (the same app runs on
it), and puts each request in the queue of the instance ``GlobalScheduler.choose`` picks from
their load reports; the outputs come back through Redis from whichever instance ran it (an idle
one may have stolen it). What the app needs to know of the engine (lengths, vocabulary, what it
cannot honour) comes from the instances' announcements.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from fd_core.cluster.config import REDIS_CALL_TIMEOUT_S, REDIS_POLL_S, SchedulerConfig
from fd_core.cluster.global_scheduler import GlobalScheduler, connect
from fd_core.engine.client import AsyncEngineClient
from fd_core.engine.config import EngineConfig
from fd_core.engine.wire import AddRequest, Ready, Stats
from fd_core.errors import SchedulerUnavailableError

WATCH_S = 0.5  # how often the instances' reports are read


class ClusterClient(AsyncEngineClient):
    @classmethod
    async def start(cls, config: EngineConfig, start_timeout: float = 120.0,
                    scheduler: SchedulerConfig | None = None) -> ClusterClient:
        """Wait (up to ``start_timeout``) for an instance of the cluster to announce itself,
        then load the tokenizer. ``config.model`` names the model the instances serve (its
        tokenizer is read here; no weights are)."""
        if scheduler is None or not scheduler.is_global:
            raise ValueError("fd router needs the cluster's Redis (--scheduler-host/--scheduler-port)")
        self = cls(config, scheduler)
        self.scheduler = scheduler.started()
        self._origin = "router-" + self.scheduler.instance_id.split("-", 1)[1]
        self._cluster = GlobalScheduler(connect(scheduler.address, timeout=REDIS_CALL_TIMEOUT_S), scheduler.topic,
                                        None, scheduler.ttl, scheduler.role)
        self._cluster_reader = GlobalScheduler(connect(scheduler.address, timeout=REDIS_POLL_S + 1.0),
                                               scheduler.topic, None, scheduler.ttl, scheduler.role)
        ready = await self._wait_for_instance(start_timeout)
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer)
        self._take_ready(ready)
        self._loads: dict = {}
        self._redis_error: str | None = None
        self._seen_live = time.monotonic()
        self._tasks = [asyncio.create_task(self._cluster_loop(), name="fd-cluster-reader"),
                       asyncio.create_task(self._watch_instances(), name="fd-cluster-watch")]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)
        return self

    async def _wait_for_instance(self, timeout: float) -> Ready:
        deadline = time.monotonic() + timeout
        while True:
            live = await asyncio.to_thread(self._cluster.live)
            for instance in live:
                info = await asyncio.to_thread(self._cluster.info, instance)
                if info is not None:
                    return msgspec.msgpack.decode(info, type=Ready)
            if time.monotonic() > deadline:
                raise SchedulerUnavailableError(
                    f"no instance of the cluster {self.scheduler.topic!r} announced itself on the global "
                    f"scheduler's Redis at {self.scheduler.address} within {timeout:g} s")
            await asyncio.sleep(WATCH_S)

    async def _watch_instances(self) -> None:
        import redis

        while True:
            try:
                self._loads = await asyncio.to_thread(self._cluster.live)
                self._redis_error = None
            except redis.RedisError as exc:
                self._loads = {}
                self._redis_error = str(exc)
            if self._loads:
                self._seen_live = time.monotonic()
            await asyncio.sleep(WATCH_S)

    def _load_tokenizer(self):
        # the tokenizer alone: the instances hold the weights, and a folder served with
        # --load-format dummy has none
        from fd_core.loader import resolve_model
        from fd_core.loader.chat_template import read_chat_template
        from fd_core.loader.formats import load_tokenizer

        tokenizer = load_tokenizer(resolve_model(self.config.tokenizer or self.config.model))
        if self.config.chat_template is not None:
            tokenizer.chat_template = read_chat_template(self.config.chat_template)
        return tokenizer

    # -- what the app asks ---------------------------------------------------------------

    def is_healthy(self) -> bool:
        return self._dead_reason is None  # the router itself; instances: cannot_serve

    def cannot_serve(self) -> str | None:
        if self._redis_error is not None:
            return f"the global scheduler's Redis at {self.scheduler.address} is unreachable ({self._redis_error})"
        if not self._loads:
            return (f"no instance of the cluster {self.scheduler.topic!r} reports to the global scheduler's Redis "
                    f"at {self.scheduler.address}")
        return None

    def report_age(self) -> float:
        return 0.0 if self._loads else time.monotonic() - self._seen_live

    def metrics(self) -> dict:
        """The cluster's figures: the instances' reports summed."""
        loads = list(self._loads.values())
        stats = Stats(num_running=sum(x.running for x in loads), num_waiting=sum(x.waiting for x in loads),
                      num_free_blocks=sum(x.free_blocks for x in loads), num_blocks=sum(x.num_blocks for x in loads))
        if stats.num_blocks:
            stats.kv_cache_usage = 1 - stats.num_free_blocks / stats.num_blocks
        return {**msgspec.structs.asdict(stats), "report_age_seconds": self.report_age(),
                "cluster_instances": len(loads)}

    # -- requests ------------------------------------------------------------------------

    def _submit(self, msg: AddRequest) -> None:
        # a disaggregated cluster's requests start on a prefill instance, which picks their
        # decode instance once the prompt is computed
        role = "prefill" if any(load.role != "mixed" for load in self._loads.values()) else "mixed"
        target = self._cluster.choose(role)  # SchedulerUnavailableError when none is live
        self._cluster.submit(target, self._origin, msg.request_id, self._encoder.encode(msg), len(msg.token_ids))

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._die("the router was shut down")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_sockets()
