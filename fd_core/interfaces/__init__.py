"""The fd plugin contract.

Everything a backend implements, and everything the core may assume of a backend, is named
here. Pure Python: no tensor library is imported in this package, so a backend author can read
it (and a type checker can check against it) without installing any accelerator stack.
"""

from fd_core.interfaces.capabilities import Capabilities
from fd_core.interfaces.communicator import Communicator
from fd_core.interfaces.memory import Memory
from fd_core.interfaces.model_runner import ModelRunner, ModelRunnerHooks, RunnerLimits
from fd_core.interfaces.ops import (
    FP8_BLOCK,
    FUSED_OPS,
    OP_SPECS,
    QUANTIZATION_METHODS,
    AttentionMetadata,
    OpSpec,
    DeferredBitmask,
    PendingSample,
    QuantizedWeight,
    SampleOutput,
    SamplingBatch,
)
from fd_core.interfaces.platform import Platform
from fd_core.interfaces.version import API_VERSION, is_compatible

__all__ = [
    "API_VERSION",
    "FP8_BLOCK",
    "FUSED_OPS",
    "OP_SPECS",
    "QUANTIZATION_METHODS",
    "AttentionMetadata",
    "Capabilities",
    "Communicator",
    "Memory",
    "ModelRunner",
    "ModelRunnerHooks",
    "RunnerLimits",
    "OpSpec",
    "DeferredBitmask",
    "PendingSample",
    "Platform",
    "QuantizedWeight",
    "SampleOutput",
    "SamplingBatch",
    "is_compatible",
]
