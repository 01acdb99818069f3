"""Suite-wide options: GPU tests are skipped where no GPU is present."""

from __future__ import annotations

import shutil
import subprocess

import pytest

# the real Redis fixture (tests/redis_server.py) for every test that names it
pytest_plugins = ["tests.redis_server"]


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a GPU; none present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
