"""The host this process runs on."""

from __future__ import annotations

import functools
import os


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (a container's
    or ``taskset``'s limit, which ``os.cpu_count`` ignores), else every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's flags from /proc/cpuinfo (``avx512f``, ``avx2``...); None where there is none
    (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return None
