"""TorchMemory: the Memory protocol on one PyTorch device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from fd_core.quantization.kv_cache import cache_layout
from fd_core.runtimes.host import host_memory
from fd_core.runtimes.host_plan import block_rows
from fd_core.runtimes.torch.ops import put_rows, take_rows, upload

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a plain view of any width (torch has few uint16/uint32 ops)

Tensor = torch.Tensor


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype the contract's name stands for: ``"float32"``, ``"bfloat16"``, ``"int64"``..."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _block_runs(src_to_dst: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(src, dst, count)`` runs of consecutive blocks: each run is one slice copy per cache.

    Blocks of a sequence are often allocated next to each other, so a swap of a whole sequence
    usually collapses to a few large transfers instead of one small one per block.
    """
    runs: list[list[int]] = []
    for src, dst in sorted((int(s), int(d)) for s, d in src_to_dst):
        last = runs[-1] if runs else None
        if last and src == last[0] + last[2] and dst == last[1] + last[2]:
            last[2] += 1
        else:
            runs.append([src, dst, 1])
    return [(s, d, n) for s, d, n in runs]


class TorchMemory:
    """Allocations on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``; ``"gpu:N"`` is read as
    ``"cuda:N"``, the spelling the Paddle runtime accepts)."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.torch_device = torch.device(device.replace("gpu", "cuda"))
        if self.torch_device.type == "cuda" and self.torch_device.index is None:
            # Pin the index: tensors report "cuda:0", and plans are keyed by device.
            self.torch_device = torch.device("cuda", torch.cuda.current_device())

    @property
    def is_cuda(self) -> bool:
        return self.torch_device.type == "cuda"

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Tensor:
        # torch.tensor copies (torch.from_numpy would share a CPU array's memory, which the
        # caller may write to later, and warns on the read-only arrays of a memory-mapped
        # checkpoint). NumPy has no bfloat16, so a cast happens on the device, after the upload.
        if self.torch_device.type == "cpu":
            tensor = torch.tensor(np.ascontiguousarray(array))
        else:
            tensor = upload(array, self.torch_device)  # a copy through pinned memory
        if dtype is not None:
            tensor = tensor.to(torch_dtype(dtype))
        return tensor

    def to_numpy(self, tensor: Tensor) -> np.ndarray:
        # A copy, never a view: on the CPU Tensor.numpy() would share the tensor's memory.
        host = tensor.detach().to("cpu", copy=True)
        if host.dtype == torch.bfloat16:  # NumPy has no bfloat16
            host = host.to(torch.float32)
        return host.numpy()

    def to_numpy_bits(self, tensor: Tensor) -> np.ndarray:
        # Host memory is copied by NumPy, on this thread: torch's CPU copy splits a large tensor
        # over its OpenMP threads, which on a host whose cores other processes keep busy wait for
        # each other (into freshly mapped pages, a 2,048-token prompt's KV cache took 463 ms
        # against NumPy's 8 ms with two busy processes on two cores; 9 ms each idle)
        tensor = tensor.detach()
        width = tensor.element_size()
        if tensor.device.type == "cpu":
            return tensor.contiguous().view(_SIGNED[width]).numpy().view(f"u{width}").copy()
        return tensor.to("cpu").view(_SIGNED[width]).numpy().view(f"u{width}")  # a new host tensor

    def from_numpy_bits(self, array: np.ndarray, dtype: str) -> Tensor:
        signed = np.ascontiguousarray(array).view(f"i{array.itemsize}")
        if self.torch_device.type == "cpu":
            tensor = torch.from_numpy(signed.copy())  # NumPy's copy, as above
        else:
            tensor = upload(signed, self.torch_device)
        return tensor.view(torch_dtype(dtype))

    def _zeros_cache(
        self, num_layers: int, shape: tuple[int, int, int], dtype: str, **where
    ) -> list[tuple[Tensor, Tensor]]:
        dt = torch_dtype(dtype)
        return [
            (torch.zeros(shape, dtype=dt, **where), torch.zeros(shape, dtype=dt, **where))
            for _ in range(num_layers)
        ]

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> list[tuple[Tensor, Tensor]]:
        row, storage = cache_layout(dtype, head_dim)
        return self._zeros_cache(num_layers, (num_blocks * block_size, num_kv_heads, row), storage,
                                 device=self.torch_device)

    def allocate_host_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> list[tuple[Tensor, Tensor]]:
        # Page-locked beside a GPU, so the copies in and out run at full bus speed and can be
        # asynchronous; pinning needs a CUDA context, so a CPU device keeps ordinary memory.
        row, storage = cache_layout(dtype, head_dim)
        return self._zeros_cache(num_layers, (num_blocks * block_size, num_kv_heads, row), storage, device="cpu",
                                 pin_memory=self.is_cuda)

    def swap_blocks(
        self,
        src: list[tuple[Tensor, Tensor]],
        dst: list[tuple[Tensor, Tensor]],
        block_size: int,
        src_to_dst: Sequence[tuple[int, int]],
    ) -> None:
        if not len(src_to_dst):
            return
        runs = _block_runs(src_to_dst)
        # Blocks are contiguous rows, so each run is a plain slice-to-slice copy: no gather, no
        # staging buffer. Between pinned host memory and a GPU such a copy can be asynchronous;
        # anywhere else non_blocking is ignored or unsafe, so it is asked only there.
        s0, d0 = src[0][0], dst[0][0]
        cross = s0.device != d0.device
        non_blocking = cross and (s0.is_pinned() or d0.is_pinned())
        for src_layer, dst_layer in zip(src, dst):
            for s_cache, d_cache in zip(src_layer, dst_layer):
                for s, d, n in runs:
                    d_cache[d * block_size : (d + n) * block_size].copy_(
                        s_cache[s * block_size : (s + n) * block_size], non_blocking=non_blocking
                    )
        # The contract: done when the call returns (the engine reuses the source blocks next).
        for tensor in (s0, d0):
            if tensor.device.type == "cuda":
                torch.cuda.synchronize(tensor.device)

    def copy_blocks(
        self,
        kv_caches: list[tuple[Tensor, Tensor]],
        block_size: int,
        src_to_dst: Sequence[tuple[int, int]],
    ) -> None:
        if not len(src_to_dst):
            return
        device = kv_caches[0][0].device
        src_rows, dst_rows = block_rows(src_to_dst, block_size)
        src, dst = torch.from_numpy(src_rows).to(device), torch.from_numpy(dst_rows).to(device)
        for key, value in kv_caches:
            # Gather every source before writing, so a block that is both a source and a
            # destination is read as it was before the call.
            for cache in (key, value):
                put_rows(cache, dst, take_rows(cache, src))

    def memory_info(self) -> tuple[int, int]:
        if self.torch_device.type == "cpu":
            return host_memory()
        if self.is_cuda:
            free, total = torch.cuda.mem_get_info(self.torch_device)
            return int(free), int(total)
        raise NotImplementedError(f"memory_info is not available for device {self.device!r}")

    def profile(self, run: Callable[[], Any]) -> int:
        """Bytes ``run()`` held on the device at its peak beyond what was allocated before it;
        afterwards the allocator's cached blocks go back to the device, so ``memory_info``
        counts only what stays allocated."""
        if not self.is_cuda:
            raise NotImplementedError(f"memory profiling is not available for device {self.device!r}")
        torch.cuda.synchronize(self.torch_device)
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        before = torch.cuda.memory_allocated(self.torch_device)
        run()
        torch.cuda.synchronize(self.torch_device)
        peak = torch.cuda.max_memory_allocated(self.torch_device) - before
        torch.cuda.empty_cache()
        return int(max(0, peak))
