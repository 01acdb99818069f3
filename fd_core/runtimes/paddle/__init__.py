"""The Paddle runtime: reference ops, memory and collectives; the one package importing paddle.

Its names are imported on first use, so that a vendor backend's platform
(``fd_core.runtimes.paddle.device``) can be discovered without importing paddle.
"""

import importlib
import warnings
from typing import Any

# Paddle warns at import that ccache (for compiling custom C++ ops) is missing; fd compiles
# nothing, so the warning only confuses users.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

# name -> the submodule defining it
_NAMES = {"PaddleCommunicator": "communicator", "init_process_group": "communicator", "PaddleMemory": "memory",
          "REFERENCE_OPS": "ops"}

__all__ = ["REFERENCE_OPS", "PaddleCommunicator", "PaddleMemory", "init_process_group"]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
