"""Wall time spent in chosen functions, for benchmarks that split an engine step into phases
(``benchmarks/host_step.py``, ``backends/cuda/benchmarks/step_phases.py``)."""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable


class PhaseTimer:
    """``wrap(owner, name, label)`` replaces ``owner.name`` (a class's method or a module's
    function) with a version that adds its wall time to ``spent[label]``."""

    def __init__(self) -> None:
        self.spent: collections.Counter = collections.Counter()

    def timed(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spent = self.spent

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        return wrapper

    def wrap(self, owner: Any, name: str, label: str) -> None:
        setattr(owner, name, self.timed(label, getattr(owner, name)))
