"""The in-tree vendor backends on Paddle, which the README's test command installs."""

from __future__ import annotations

from importlib import metadata

import pytest

VENDOR_BACKENDS = ["xpu", "iluvatar", "dcu", "gcu"]


def require_installed(name: str) -> None:
    """Fail (not skip) the calling test when fd-backend-NAME is missing: CI must test it."""
    if not any(ep.name == name for ep in metadata.entry_points(group="fd.backends")):
        pytest.fail(f"fd-backend-{name} is not installed: pip install -e backends/{name} (the README's test "
                    f"command does)")
