"""Start-up phases as log lines with their durations, and progress a log file can show.

Every phase of an engine's start-up (resolving the backend, reading the checkpoint, loading
weights, sizing and allocating the KV cache, a backend's warm-up such as CUDA graph capture)
runs inside ``phase``, which logs when it starts and how long it took, on the ``fd.startup``
logger. Long loops go through ``progress``: a tqdm bar on a terminal, a log line every few
seconds otherwise (containers, systemd, ``2> file``), nothing in a process that does not log
INFO (the tensor-parallel ranks other than 0, see ``fd_core.logs.rank_level``).

Backends may use both (``from fd_core.phases import phase``): it needs no tensor library.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any, TypeVar

log = logging.getLogger("fd.startup")

PROGRESS_INTERVAL_S = 5.0  # between two progress lines in a log

T = TypeVar("T")


class Phase:
    """A phase in progress: ``detail`` (set it inside the block) ends its last line."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.detail = ""
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


@contextmanager
def phase(what: str) -> Iterator[Phase]:
    """Log ``what...`` now and ``what: done in S s (detail)`` at the end of the block, or
    ``what: failed after S s`` if it raises."""
    current = Phase(what)
    log.info("%s...", what)
    try:
        yield current
    except BaseException:
        log.info("%s: failed after %.2f s", what, current.elapsed)
        raise
    detail = f" ({current.detail})" if current.detail else ""
    log.info("%s: done in %.2f s%s", what, current.elapsed, detail)


@cache
def _bar_class() -> type:
    from tqdm.auto import tqdm  # 50-80 ms to import: only where a bar is drawn

    class Bar(tqdm):
        pass

    # A thread lock: tqdm's default also takes a multiprocessing lock (even for a disabled
    # bar), a named semaphore that leaks, with the resource tracker's "leaked semaphore"
    # warning, when its process is terminated, as an engine core stopped during start-up is.
    Bar.set_lock(threading.RLock())
    return Bar


def bar(**kwargs: Any) -> Any:
    """A tqdm bar (``tqdm.auto``'s arguments) that holds no multiprocessing lock."""
    return _bar_class()(**kwargs)


def progress(items: Iterable[T], total: int, what: str, unit: str,
             interval: float = PROGRESS_INTERVAL_S) -> Iterator[T]:
    """``items``, with progress shown as a bar on a terminal, else as a log line (``what: 120/272
    tensors (44%) after 5.0 s``) at most every ``interval`` seconds."""
    if not log.isEnabledFor(logging.INFO):
        yield from items
        return
    if sys.stderr.isatty():
        with bar(iterable=items, total=total, desc=what, unit=unit, leave=False) as shown:
            yield from shown
        return
    start = last = time.perf_counter()
    for done, item in enumerate(items, 1):
        yield item
        now = time.perf_counter()
        if now - last >= interval and done < total:
            last = now
            log.info("%s: %d/%d %ss (%d%%) after %.1f s", what, done, total, unit, 100 * done // max(total, 1),
                     now - start)
