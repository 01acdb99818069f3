"""The Paddle runtime: reference ops, memory and collectives; the one package importing paddle."""

from fd_core.runtimes.paddle.communicator import PaddleCommunicator
from fd_core.runtimes.paddle.memory import PaddleMemory
from fd_core.runtimes.paddle.ops import REFERENCE_OPS

__all__ = ["REFERENCE_OPS", "PaddleCommunicator", "PaddleMemory"]
