"""The Paddle runtime: reference ops, memory and collectives; the one package importing paddle."""

import warnings

# Paddle warns at import that ccache (for compiling custom C++ ops) is missing; fd compiles
# nothing, so the warning only confuses users.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

from fd_core.runtimes.paddle.communicator import PaddleCommunicator, init_process_group  # noqa: E402
from fd_core.runtimes.paddle.memory import PaddleMemory  # noqa: E402
from fd_core.runtimes.paddle.ops import REFERENCE_OPS  # noqa: E402

__all__ = ["REFERENCE_OPS", "PaddleCommunicator", "PaddleMemory", "init_process_group"]
