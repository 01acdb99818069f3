"""The PyTorch runtime: reference ops and memory; the one package importing torch.

A backend names it as runtime ``"torch"`` (``fd_core.plugins.registry.RUNTIMES``); its
``REFERENCE_OPS`` then fill in every op the backend does not implement itself. Its names are
imported on first use, so that a vendor backend's platform (``fd_core.runtimes.torch.device``)
can be discovered without importing torch.
"""

import importlib
from typing import Any

# name -> the submodule defining it
_NAMES = {"TorchCommunicator": "communicator", "init_process_group": "communicator", "TorchMemory": "memory",
          "REFERENCE_OPS": "ops"}

__all__ = ["REFERENCE_OPS", "TorchCommunicator", "TorchMemory", "init_process_group"]


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
