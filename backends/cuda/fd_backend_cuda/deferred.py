"""The ``deferred_bitmask`` op: a step's grammar mask that the host fills after the sample
that applies it is queued (fd-core's grammar thread computes it while the engine's thread
queues the next step).

The mask and a flag word share one block of pinned host memory. ``sample_async`` queues on
its stream a wait for the flag (the driver's ``cuStreamWaitValue32``: the GPU polls the word
in host memory, no host thread waits), then the mask's copy to the device, then its use;
``ready()`` sets the flag once the host has written the mask. The block is torch's pinned
memory, whose allocator keeps it until the copy queued behind the wait has run.

The mask's words are written before the flag by the same host, and an x86 host's stores are
seen in the order they were made; this was measured on x86 hosts only (a host with a weaker
memory order, e.g. Arm, would need a fence between the two).
"""

from __future__ import annotations

import ctypes
import functools

import torch

_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0


@functools.cache
def _wait_value() -> ctypes._CFuncPtr:
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuStreamWaitValue32_v2  # the driver's name for it since CUDA 11.7
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class GatedBitmask:
    """A ``DeferredBitmask``: ``array`` (int32 ``[rows, words]``) in pinned host memory, which
    the device reads only after ``ready()``."""

    def __init__(self, rows: int, words: int) -> None:
        self.shape = (rows, words)
        size = rows * words
        self._block = torch.empty(size + 1, dtype=torch.int32, pin_memory=True)
        host = self._block.numpy()
        self.array = host[:size].reshape(rows, words)
        self._flag = host[size:]
        self._flag[0] = 0  # a block from the allocator's cache holds its last use's flag

    def ready(self) -> None:
        self._flag[0] = 1

    def upload(self, device: torch.device) -> torch.Tensor:
        """The mask on ``device``, as work queued on its current stream behind a wait for
        ``ready()``; nothing here waits."""
        stream = torch.cuda.current_stream(device)
        size = self.shape[0] * self.shape[1]
        status = _wait_value()(stream.cuda_stream, self._block[size:].data_ptr(), 1, _WAIT_GEQ)
        if status != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {status}")
        return self._block[:size].view(self.shape).to(device, non_blocking=True)


def deferred_bitmask(rows: int, words: int) -> GatedBitmask:
    return GatedBitmask(rows, words)
