"""The host machine as every runtime sees it (no tensor library here)."""

from __future__ import annotations

import os


def host_memory() -> tuple[int, int]:
    """``(available, total)`` host RAM in bytes."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
