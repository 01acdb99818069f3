"""The built-in CPU backend: PaddlePaddle on the host.

Registered through fd-core's own ``fd.backends`` entry point, exactly like an external backend,
so the discovery path every vendor relies on is exercised by the default install.
"""

from __future__ import annotations

import os

from fd_core.interfaces import Capabilities
from fd_core.plugins import hookimpl

FD_API_VERSION = "1.1"


class CpuPlatform:
    name = "cpu"
    device_type = "cpu"
    runtime = "paddle"
    # A step's length bounds the gap between a stream's tokens, and a 2-core host computes
    # roughly 100-150 prompt tokens/s: 256 keeps that gap at 2-4 s while a long prompt
    # prefills (2048 makes it ~26 s) for ~5% more prefill time (docs/PERFORMANCE.md,
    # "Scheduling").
    default_max_num_batched_tokens = 256

    def is_available(self) -> tuple[bool, str]:
        return True, ""

    def device_count(self) -> int:
        # a "device" is a process on this host: tensor parallelism runs one per rank (gloo)
        return os.cpu_count() or 1

    def capabilities(self) -> Capabilities:
        return Capabilities(
            dtypes=frozenset({"float32"}),
            quantization=frozenset(),
            kv_cache_dtypes=frozenset({"float32"}),
            graph_capture=False,
            prefix_caching=True,
            chunked_prefill=True,
            kv_swap=True,
            collective_library="gloo",
            pinned_host_memory=False,
            device_count=self.device_count(),
            memory_query=True,
        )

    def memory(self, device_index: int = 0):
        from fd_core.runtimes.paddle import PaddleMemory

        return PaddleMemory("cpu")

    def communicator(self, rank: int = 0, world_size: int = 1, rendezvous: str | None = None):
        from fd_core.runtimes.paddle import PaddleCommunicator, init_process_group

        if world_size > 1:
            init_process_group(rank, world_size, rendezvous, backend="gloo")
        return PaddleCommunicator(rank=rank, world_size=world_size)

    def runner_hooks(self):
        return None

    def describe_devices(self) -> list[str]:
        return [f"cpu ({os.cpu_count()} cores)"]


@hookimpl
def fd_platforms():
    return [CpuPlatform()]


@hookimpl
def fd_register_ops(registry):
    # The Paddle reference ops are this backend's implementation, not a fallback: register
    # them under the cpu device type so no fallback warning fires for the default install.
    from fd_core.runtimes.paddle import REFERENCE_OPS

    for op, fn in REFERENCE_OPS.items():
        registry.register(op, "cpu", fn, name="reference", priority=0)
