"""The host machine as every runtime sees it (no tensor library here)."""

from __future__ import annotations

import ctypes
import os
import sys


def host_memory() -> tuple[int, int]:
    """``(available, total)`` host RAM in bytes."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


_MALLOC_TUNED = False


def keep_freed_host_memory() -> None:
    """Make glibc keep large freed blocks for reuse instead of returning them to the OS.

    glibc maps blocks above its (dynamic) mmap threshold freshly and unmaps them on free, so
    large temporaries page-fault back in every time: Paddle's CPU allocator goes straight to
    malloc, and that made decode attention about 5x slower on a 2-core host; a prefill or decode
    instance's per-request host arrays of KV blocks (megabytes each) paid it too, and on a host
    whose cores other processes kept busy torch's multi-threaded copy into fresh pages took
    933 ms for a 2,048-token prompt where 33 ms with freed blocks kept (docs/PERFORMANCE.md).
    Process-wide, idempotent, Linux/glibc only, and skipped where the user set the MALLOC_*
    variables.
    """
    global _MALLOC_TUNED
    if _MALLOC_TUNED or not sys.platform.startswith("linux"):
        return
    _MALLOC_TUNED = True
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value
        libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune
