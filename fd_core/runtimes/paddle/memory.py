"""PaddleMemory: the Memory protocol on one Paddle device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import paddle

from fd_core.quantization.kv_cache import cache_layout
from fd_core.runtimes.host import host_memory, keep_freed_host_memory
from fd_core.runtimes.host_plan import block_rows
from fd_core.runtimes.paddle.ops import put_rows, take_rows

Tensor = paddle.Tensor


class PaddleMemory:
    """Allocations on ``device`` (``"cpu"``, ``"gpu:0"``, ``"cuda:0"``, ``"xpu:0"``, a custom
    device such as ``"npu:0"``...). On the CPU it also calls :func:`keep_freed_host_memory`
    unless ``tune_host_malloc`` is False."""

    def __init__(self, device: str = "cpu", tune_host_malloc: bool = True) -> None:
        self.device = device
        self.place = paddle.device.device_to_place(device.replace("cuda", "gpu"))
        if tune_host_malloc and isinstance(self.place, paddle.CPUPlace):
            keep_freed_host_memory()

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Tensor:
        # NumPy has no bfloat16: upload as is and let Paddle cast on the device.
        tensor = paddle.to_tensor(np.ascontiguousarray(array), place=self.place)
        if dtype is not None and tensor.dtype != getattr(paddle, dtype):
            tensor = tensor.astype(dtype)
        return tensor

    def to_numpy(self, tensor: Tensor) -> np.ndarray:
        if tensor.dtype == paddle.bfloat16:
            tensor = tensor.astype(paddle.float32)
        return tensor.numpy()

    def to_numpy_bits(self, tensor: Tensor) -> np.ndarray:
        array = tensor.numpy()  # Paddle gives bfloat16 as its uint16 bits already
        return array.view(f"u{array.itemsize}")

    def from_numpy_bits(self, array: np.ndarray, dtype: str) -> Tensor:
        # a uint16 array is what Paddle takes for bfloat16's bits
        stored = np.uint16 if dtype == "bfloat16" else np.dtype(dtype)
        return paddle.to_tensor(np.ascontiguousarray(array).view(stored), place=self.place)

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> list[tuple[Tensor, Tensor]]:
        row, dtype = cache_layout(dtype, head_dim)
        shape = [num_blocks * block_size, num_kv_heads, row]
        return [
            (
                paddle.zeros(shape, dtype=dtype, device=self.place),
                paddle.zeros(shape, dtype=dtype, device=self.place),
            )
            for _ in range(num_layers)
        ]

    def allocate_host_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> list[tuple[Tensor, Tensor]]:
        # page-locked beside a GPU, so the copies in and out run at full bus speed
        place = paddle.CUDAPinnedPlace() if isinstance(self.place, paddle.CUDAPlace) else paddle.CPUPlace()
        row, dtype = cache_layout(dtype, head_dim)
        shape = [num_blocks * block_size, num_kv_heads, row]
        return [
            (paddle.zeros(shape, dtype=dtype).to(place), paddle.zeros(shape, dtype=dtype).to(place))
            for _ in range(num_layers)
        ]

    def swap_blocks(
        self,
        src: list[tuple[Tensor, Tensor]],
        dst: list[tuple[Tensor, Tensor]],
        block_size: int,
        src_to_dst: Sequence[tuple[int, int]],
    ) -> None:
        if not len(src_to_dst):
            return
        src_rows, dst_rows = block_rows(src_to_dst, block_size)
        src_place, dst_place = src[0][0].place, dst[0][0].place
        src_index = paddle.to_tensor(src_rows, place=src_place)
        dst_index = paddle.to_tensor(dst_rows, place=dst_place)
        for src_layer, dst_layer in zip(src, dst):
            for s_cache, d_cache in zip(src_layer, dst_layer):
                # every source row is gathered before any is written, so copying within one
                # cache (copy_blocks) reads a block that is also a destination as it was
                rows = take_rows(s_cache, src_index)
                put_rows(d_cache, dst_index, rows if src_place == dst_place else rows.to(dst_place))

    def copy_blocks(
        self,
        kv_caches: list[tuple[Tensor, Tensor]],
        block_size: int,
        src_to_dst: Sequence[tuple[int, int]],
    ) -> None:
        self.swap_blocks(kv_caches, kv_caches, block_size, src_to_dst)

    def memory_info(self) -> tuple[int, int]:
        if isinstance(self.place, paddle.CPUPlace):
            return host_memory()
        if isinstance(self.place, paddle.CUDAPlace):
            index = self.place.get_device_id()
            total = paddle.device.cuda.get_device_properties(index).total_memory
            # Paddle exposes no cudaMemGetInfo; what its allocator holds is what others cannot use.
            return total - paddle.device.cuda.memory_reserved(index), total
        raise NotImplementedError(f"memory_info is not available for device {self.device!r}")

    def profile(self, run: Callable[[], Any]) -> int:
        # Not declared by any Paddle platform yet (Capabilities.memory_profiling): the CPU sizes
        # its cache from --kv-cache-memory-gb, and no Paddle GPU build is reachable here to test.
        raise NotImplementedError("the Paddle runtime does not profile device memory")
