"""A thread that computes a step's grammar masks while the engine's thread goes on.

With asynchronous scheduling on a backend that has the ``deferred_bitmask`` op, the engine
queues a step's sample without its bitmask: the device holds the sample until the host says
the mask is ready. This thread fills the mask (llguidance computes it without the GIL), says
so, then waits for the step's tokens and advances each row's grammar with its token, so that
the next step's mask can be filled, and the engine learns which sequences the grammar ended.

One thread takes the jobs in the order they come, and it alone touches the matchers while the
engine runs this way: a step's fill comes after the advance of the step before.

Why a thread: where the forward is short (SmolLM2 at 32 rows on an H100: 2.4 ms a step, 1.2-1.5
ms of masks), computing the masks on the engine's thread makes every step that much longer;
here the engine's thread schedules and queues the next step meanwhile (+16% a token against
+49%; docs/PERFORMANCE.md, "Structured output"). The engine defers only steps of at least
``core.DEFER_ROWS`` constrained rows: for fewer, the hand-over between threads costs more.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import numpy as np

from fd_core.engine.structured.matchers import Grammar, GrammarMatchers
from fd_core.interfaces.ops import DeferredBitmask, PendingSample

log = logging.getLogger("fd.engine")


class Advance:
    """The grammars of a step's rows advanced by its tokens: ``wait()`` returns, per row, why
    the row's sequence ends there (``Grammar.advance``: ``"stop"``, ``"abort"``) or None. Row
    by row: llguidance's ``consume_token_par`` (one call without the GIL) took 0.39 ms a step
    for 32 rows against 0.16 ms (H100 host, SmolLM2), and the next fill waits for it."""

    def __init__(self, grammars: list[Grammar | None], pending: PendingSample, worker: MaskWorker) -> None:
        self.grammars, self.pending, self.worker = grammars, pending, worker
        self.ended: list[str | None] = []
        self.done = threading.Event()

    def run(self) -> None:
        tokens = self.pending.result().token_ids.tolist()
        self.ended = [None if g is None else g.advance(t) for g, t in zip(self.grammars, tokens)]

    def wait(self) -> list[str | None]:
        self.done.wait()
        self.worker.check()
        return self.ended


class MaskWorker:
    """Fills deferred bitmasks and advances grammars, in order, on a thread of its own."""

    def __init__(self, matchers: GrammarMatchers) -> None:
        self.matchers = matchers
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fd-grammar", daemon=True)
        self._thread.start()

    def fill(self, rows: list[tuple[Grammar, int]], mask: DeferredBitmask, base: np.ndarray | None) -> None:
        """Queue: write the mask of each ``(grammar, row)`` into ``mask.array`` as
        ``GrammarMatchers.fill_rows`` does, then ``mask.ready()``. Which grammars hold their
        row's token is decided then, after the step before has advanced them (a grammar that
        waits for its start may wake on that step's token)."""
        self._jobs.put((rows, mask, base))

    def advance(self, grammars: list[Grammar | None], pending: PendingSample) -> Advance:
        """Queue: once the step's tokens (``pending``) reach the host, advance each row's
        grammar (None: a row without one) with its token."""
        job = Advance(grammars, pending, self)
        self._jobs.put(job)
        return job

    def check(self) -> None:
        """Raise what made the thread fail, if it did."""
        if self._error is not None:
            raise RuntimeError(f"the grammar thread failed: {self._error!r}") from self._error

    def close(self, timeout: float = 30.0) -> None:
        """Finish the jobs queued (a device may be waiting for a mask) and stop the thread
        (idempotent; a daemon thread stuck on a failed device is left behind after ``timeout``)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, Advance):
                try:
                    if self._error is None:
                        job.run()
                except BaseException as exc:  # the engine's thread raises it (check)
                    log.exception("the grammar thread failed advancing a step")
                    self._error = exc
                finally:
                    job.done.set()
                continue
            rows, mask, base = job
            try:
                if self._error is None:
                    self.matchers.fill_rows(rows, mask.array, base)
            except BaseException as exc:
                log.exception("the grammar thread failed filling a step's masks")
                self._error = exc
            finally:
                mask.ready()  # always: the device holds the step's sample until then
