"""Whether a chip's driver has created its device files, without importing a tensor library.

Importing Paddle or PyTorch to ask for a device count costs about a second each, and discovery
(``fd backends``, every engine start and tensor-parallel worker) asks every installed backend. A
chip's kernel driver creates its device files (``/dev/nvidia0``, ``/dev/xpu0``, ``/dev/kfd``...)
before any library can see it, so where none exists the answer is known for the price of a
``glob``. Where one does, the platform still asks its library. ``FD_IGNORE_DEVICE_NODES=1`` skips
the check for a driver that names its files otherwise.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

IGNORE_ENV = "FD_IGNORE_DEVICE_NODES"


def missing(patterns: Sequence[str], chip: str) -> str:
    """One sentence saying that no file matches ``patterns`` (globs), or "" when one does, when
    there are no patterns, when the check is switched off, or where there is no ``/dev``."""
    if not patterns or os.environ.get(IGNORE_ENV, "") not in ("", "0") or not os.path.isdir("/dev"):
        return ""
    if any(glob.glob(p) for p in patterns):
        return ""
    return (f"no {chip} device: none of {', '.join(patterns)} exists (the driver creates them; in a container, "
            f"pass the devices in); set {IGNORE_ENV}=1 to ask the library anyway")
