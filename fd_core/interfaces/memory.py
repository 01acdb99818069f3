"""Memory: moving arrays between NumPy and a device, and the paged KV cache."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

Tensor = Any  # a tensor of the runtime (paddle.Tensor, torch.Tensor, ...); opaque to the core


@runtime_checkable
class Memory(Protocol):
    """Owns every allocation on one device.

    KV-cache layout, fixed by the contract so that the engine's block tables mean the same thing
    on every backend: one ``(key, value)`` pair per layer, each of shape
    ``[num_blocks * block_size, num_kv_heads, head_dim]``; token slot ``s`` lives in block
    ``s // block_size`` at offset ``s % block_size``.
    """

    device: str  # e.g. "cpu", "cuda:0"

    def from_numpy(self, array: np.ndarray, dtype: str | None = None) -> Tensor:
        """Copy a host array to the device, optionally casting (``"float32"``, ``"bfloat16"``...)."""
        ...

    def to_numpy(self, tensor: Tensor) -> np.ndarray:
        """Copy a device tensor to a host array (bfloat16 comes back as float32)."""
        ...

    def allocate_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> list[tuple[Tensor, Tensor]]:
        """Zero-filled KV cache in the layout above."""
        ...

    def copy_blocks(
        self,
        kv_caches: list[tuple[Tensor, Tensor]],
        block_size: int,
        src_to_dst: Sequence[tuple[int, int]],
    ) -> None:
        """Copy whole blocks ``src -> dst`` in every layer, in place."""
        ...

    # Since API 1.1, and needed only where Capabilities.kv_swap is declared:

    def allocate_host_kv_cache(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
    ) -> list[tuple[Tensor, Tensor]]:
        """A KV cache in the layout above in host memory (page-locked where the backend
        declares ``pinned_host_memory``), the swap space for preempted sequences."""
        ...

    def swap_blocks(
        self,
        src: list[tuple[Tensor, Tensor]],
        dst: list[tuple[Tensor, Tensor]],
        block_size: int,
        src_to_dst: Sequence[tuple[int, int]],
    ) -> None:
        """Copy whole blocks from one cache to another — device to host or host to device —
        in every layer; done when the call returns."""
        ...

    # Since API 1.15, optional (where absent, fd-core converts through to_numpy / from_numpy):

    def to_numpy_bits(self, tensor: Tensor) -> np.ndarray:
        """A host copy of ``tensor``'s elements as stored, as unsigned integers of their width
        (bfloat16 as uint16): nothing converted, so a bfloat16 KV cache leaves a prefill
        instance at its own size, not widened to float32."""
        ...

    def from_numpy_bits(self, array: np.ndarray, dtype: str) -> Tensor:
        """``to_numpy_bits``' inverse: ``array``'s unsigned integers as elements of ``dtype``
        on the device, unconverted."""
        ...

    def memory_info(self) -> tuple[int, int]:
        """``(free_bytes, total_bytes)`` of the device; host RAM for the CPU."""
        ...

    # Since API 1.2, and needed only where Capabilities.memory_profiling is declared:

    def profile(self, run: Callable[[], Any]) -> int:
        """Call ``run()`` (a forward of the largest step the engine will schedule) and return
        the most bytes it held on the device at once beyond what was allocated before it.
        Afterwards memory the runtime cached but no longer uses is given back to the device,
        so that ``memory_info`` counts only what stays allocated (weights, context)."""
        ...
