"""The CUDA platform: NVIDIA GPUs through PyTorch (runtime "torch")."""

from __future__ import annotations

import os

from fd_core.interfaces import Capabilities
from fd_core.interfaces.capabilities import SPECULATIVE_METHODS
from fd_core.runtimes import device_nodes

# the NVIDIA driver's device files: where none exists, no GPU is here and torch is not imported
DEVICE_NODES = ("/dev/nvidia[0-9]*",)


class CudaPlatform:
    name = "cuda"
    device_type = "cuda"
    runtime = "torch"
    # A GPU computes a step of 8192 prompt tokens of a small model in ~10 ms: the larger step
    # halves the steps of a prefill-heavy load (vLLM picks the same for H100-class GPUs) while a
    # stream's longest gap stays short; --max-num-batched-tokens 2048 trades back.
    default_max_num_batched_tokens = 8192
    # No default_long_prefill_token_threshold (API 1.4): at milliseconds a step, a request behind
    # a long prompt waits a fraction of a second for it; --long-prefill-token-threshold sets one.

    def is_available(self) -> tuple[bool, str]:
        absent = device_nodes.missing(DEVICE_NODES, self.name)
        if absent:
            return False, absent
        try:
            import torch
        except ImportError:
            return False, "PyTorch is not installed (pip install torch)"
        if not torch.cuda.is_available():
            if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
                return False, "CUDA_VISIBLE_DEVICES is empty"
            return False, f"torch {torch.__version__} sees no CUDA device"
        return True, ""

    def device_count(self) -> int:
        if not self.is_available()[0]:
            return 0
        import torch

        return torch.cuda.device_count()

    def capabilities(self) -> Capabilities:
        dtypes = {"float32", "float16"}
        quantization = {"wint8", "wint4"}
        kv_cache = {"int8"}  # quantized KV caches (fd_core.quantization.kv_cache), read in the attention kernel
        if self.is_available()[0]:
            import torch

            major, minor = torch.cuda.get_device_capability(0)
            if major >= 8:  # bfloat16 from Ampere (sm80)
                dtypes.add("bfloat16")
            if (major, minor) >= (8, 9):  # float8 e4m3 conversions from Ada (sm89)
                quantization.add("block_wise_fp8")
                kv_cache.add("fp8_e4m3")
        return Capabilities(
            dtypes=frozenset(dtypes),
            kv_cache_dtypes=frozenset(dtypes | kv_cache),
            quantization=frozenset(quantization),
            graph_capture=True,
            prefix_caching=True,
            chunked_prefill=True,
            kv_swap=True,
            speculative_methods=frozenset(SPECULATIVE_METHODS),
            collective_library="nccl",
            pinned_host_memory=True,
            device_count=self.device_count(),
            memory_query=True,
            memory_profiling=True,
        )

    def memory(self, device_index: int = 0):
        import torch
        from fd_core.runtimes.torch import TorchMemory

        # Triton launches, CUDA graphs and NCCL work on the current device: make it this one
        torch.cuda.set_device(device_index)
        return TorchMemory(f"cuda:{device_index}")

    def communicator(self, rank: int = 0, world_size: int = 1, rendezvous: str | None = None):
        import torch
        from fd_core.runtimes.torch import TorchCommunicator, init_process_group

        if world_size > 1:
            torch.cuda.set_device(rank % max(1, self.device_count()))  # rank r drives GPU r
            init_process_group(rank, world_size, rendezvous, backend="nccl")
        return TorchCommunicator(rank=rank, world_size=world_size)

    def runner_hooks(self):
        try:
            from fd_backend_cuda.graphs import CudaGraphHooks
        except ImportError:  # no triton: eager steps through the torch reference ops
            return None
        return CudaGraphHooks()

    def describe_devices(self) -> list[str]:
        import torch

        return [torch.cuda.get_device_name(i) for i in range(self.device_count())]
