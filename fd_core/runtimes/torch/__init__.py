"""The PyTorch runtime: reference ops and memory; the one package importing torch.

A backend names it as runtime ``"torch"`` (``fd_core.plugins.registry.RUNTIMES``); its
``REFERENCE_OPS`` then fill in every op the backend does not implement itself.
"""

from fd_core.runtimes.torch.communicator import TorchCommunicator, init_process_group
from fd_core.runtimes.torch.memory import TorchMemory
from fd_core.runtimes.torch.ops import REFERENCE_OPS

__all__ = ["REFERENCE_OPS", "TorchCommunicator", "TorchMemory", "init_process_group"]
