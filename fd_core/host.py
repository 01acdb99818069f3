"""The host this process runs on."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (a container's
    or ``taskset``'s limit, which ``os.cpu_count`` ignores), else every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
