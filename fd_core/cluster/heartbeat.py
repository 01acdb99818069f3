"""An instance's load report, written by a thread of its own.

Written from the engine loop, the report waited for each step: one step longer than the TTL (a
long prefill on a slow or crowded CPU) let the load key expire, so a live instance looked dead,
fd router refused requests for want of one, and another instance took its queue over and ended
its running requests. Here the engine loop only leaves its latest ``Load``; a thread reports it
every ``interval`` seconds. An engine loop that has not come back for ``STALL_S`` (hung, not
busy) gets no more reports, so that the cluster reaps it and its requests end with an error
instead of waiting for ever.
"""

from __future__ import annotations

import logging
import threading
import time

from fd_core.cluster.global_scheduler import GlobalScheduler, Load

log = logging.getLogger("fd.cluster")

STALL_S = 60.0  # far longer than any one step, chunked prefill bounds them


class Heartbeat:
    def __init__(self, scheduler: GlobalScheduler, interval: float) -> None:
        """``scheduler``: one with a Redis client of its own (clients are not shared across threads here)."""
        self.scheduler = scheduler
        self.interval = interval
        self._load: Load | None = None
        self._updated = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stalled = False

    def update(self, load: Load) -> None:
        """The engine loop's latest load (no Redis call here)."""
        self._load, self._updated = load, time.monotonic()

    def start(self) -> None:
        """Report the latest load at once, by the caller's thread, then every ``interval`` by
        the reporting thread. Raises where Redis is away (the engine loop handles that); once
        started, does nothing."""
        if self._thread is None:
            self.scheduler.heartbeat(self._load)
            self._thread = threading.Thread(target=self._run, name="fd-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)

    def _run(self) -> None:
        import redis

        while not self._stop.wait(self.interval):
            if time.monotonic() - self._updated > STALL_S:
                if not self._stalled:
                    log.error("the engine loop has not come back for %.0f s; this instance stops reporting its "
                              "load, so that another takes its requests over", STALL_S)
                self._stalled = True
                continue
            if self._stalled:
                log.warning("the engine loop is back; this instance reports its load again")
                self._stalled = False
            try:
                self.scheduler.heartbeat(self._load)
            except redis.RedisError:
                pass  # the engine loop logs Redis going away and coming back
