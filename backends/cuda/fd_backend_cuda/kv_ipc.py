"""``cuda_ipc``: a KV-cache connector between GPUs of one host (``--cache-transfer-protocol
cuda_ipc``, API 1.16's device connectors). A request's blocks never touch host memory: the
prefill instance copies them into a device buffer of its own, which it shares once through CUDA
IPC; the decode instance's connector opens that buffer once, copies the request's bytes into
tensors on its own GPU (a peer copy over NVLink or PCIe) and acknowledges, and the buffer takes
the next request. A decode instance without the GPU memory for a request refuses it, and the
sender tries another. On an H100 pair the host-staged path (``tcp``) moved 2.4 GiB/s and a peer copy
275 GiB/s (docs/PERFORMANCE.md).

The control messages are fd-core's ``tcp`` connector's (ZeroMQ), so both ends run on one host,
and each must see the other's GPU: list both in ``CUDA_VISIBLE_DEVICES``, the instance's own
first (fd runs on its first visible GPU), e.g. ``0,1`` for the prefill instance and ``1,0`` for
the decode instance. A GPU the receiver cannot see fails the transfer, saying so.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from fd_core.cluster.tcp_transfer import TcpTransfer
from fd_core.errors import ConfigError
from fd_core.interfaces.kv_transfer import KVTransferError

log = logging.getLogger("fd.cluster")

ALIGN = 256  # each array's offset in a buffer: the copies stay vectorised
MIN_BUFFER = 64 << 20


@dataclass
class _Buffer:
    tensor: Any  # uint8, on the sender's GPU
    shared: dict[str, list] = field(default_factory=dict)  # endpoint -> what opens it there

    @property
    def size(self) -> int:
        return self.tensor.numel()


class CudaIpcTransfer(TcpTransfer):
    name = "cuda_ipc"
    device = "cuda"  # hands and takes this platform's tensors (API 1.16)

    def __init__(self, timeout: float = 30.0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--cache-transfer-protocol cuda_ipc: no CUDA GPU is visible to this process")
        self._torch = torch
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._uuid = str(torch.cuda.get_device_properties(self._device).uuid)
        self._lock = threading.Lock()  # the buffers: taken on the engine's thread, given back on the connector's
        self._free: list[_Buffer] = []
        self._lent: dict[str, tuple[_Buffer, int]] = {}  # request id -> (buffer, bytes), until acknowledged
        self._opened: dict[bytes, Any] = {}  # receiving: a sender's buffer, opened once (the connector's thread)
        # receiving copies run on a stream of their own: on the default one they would queue
        # behind the decode engine's steps
        self._stream: Any = None
        super().__init__(timeout)

    # -- sending (the engine's thread) --------------------------------------------------

    def send(self, endpoint: str, request_id: str, header: bytes, arrays: list) -> None:
        torch = self._torch
        if not endpoint.startswith("tcp://"):
            raise KVTransferError(f"the cuda_ipc KV transfer sends to tcp:// endpoints, not {endpoint!r}")
        if not all(torch.is_tensor(t) and t.device == self._device for t in arrays):
            raise KVTransferError(f"the cuda_ipc KV transfer moves tensors on {self._device}")
        offsets, total = [], 0
        for t in arrays:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        buffer = self._take(max(total, 1))
        for t, offset in zip(arrays, offsets):
            n = t.numel() * t.element_size()
            buffer.tensor[offset : offset + n].view(t.dtype).view(t.shape).copy_(t)
        # the receiver reads from another process: the bytes must be there first
        torch.cuda.current_stream(self._device).synchronize()
        opener = buffer.shared.get(endpoint)
        if opener is None:  # each receiver gets a share of its own (torch counts who holds it)
            opener = buffer.shared[endpoint] = [self._uuid, *buffer.tensor.untyped_storage()._share_cuda_()[1:]]
        layout = msgspec.msgpack.encode([(str(t.dtype).removeprefix("torch."), list(t.shape), o)
                                         for t, o in zip(arrays, offsets)])
        with self._lock:
            self._lent[request_id] = (buffer, sum(t.numel() * t.element_size() for t in arrays))
        try:
            self._commands.send_multipart([b"send", endpoint.encode(), request_id.encode(), header, layout,
                                           msgspec.msgpack.encode(opener)], copy=False)
        except zmq.ZMQError as exc:
            self._release(request_id)
            raise KVTransferError(f"the cuda_ipc KV transfer is closed: {exc}") from None

    def _take(self, nbytes: int) -> _Buffer:
        with self._lock:
            fits = [b for b in self._free if b.size >= nbytes]
            if fits:
                buffer = min(fits, key=lambda b: b.size)
                self._free.remove(buffer)
                return buffer
        # kept for the requests after this one: each new buffer costs the receiver an IPC open
        size = max(MIN_BUFFER, 1 << math.ceil(math.log2(nbytes)))
        return _Buffer(self._torch.empty(size, dtype=self._torch.uint8, device=self._device))

    # -- the connector's thread ---------------------------------------------------------

    def _payload_bytes(self, request_id: str, arrays: list[zmq.Frame]) -> int:
        with self._lock:
            entry = self._lent.get(request_id)
        return entry[1] if entry is not None else 0

    def _release(self, request_id: str) -> None:
        with self._lock:
            entry = self._lent.pop(request_id, None)
            if entry is not None:
                self._free.append(entry[0])

    def _abandon(self, request_id: str) -> None:
        # a receiver that did not answer may still copy from the buffer: it takes no other request
        with self._lock:
            self._lent.pop(request_id, None)

    def _incoming(self, layout: list, frames: list[zmq.Frame]) -> list:
        torch = self._torch
        if len(frames) != 1:
            raise ValueError("a cuda_ipc transfer carries one shared buffer")
        torch.cuda.set_device(self._device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        with torch.cuda.stream(self._stream):
            out = self._copy_in(layout, msgspec.msgpack.decode(frames[0].bytes))
        self._stream.synchronize()  # the sender reuses its buffer once acknowledged
        return out

    def _copy_in(self, layout: list, opener: list) -> list:
        torch = self._torch
        uuid, handle, *share = opener
        base = self._opened.get(handle)
        if base is None:
            index = self._visible(uuid)
            storage = torch.UntypedStorage._new_shared_cuda(index, handle, *share)
            base = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)
            self._opened[handle] = base
        items = []
        for dtype, shape, offset in layout:
            dt = getattr(torch, dtype, None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            n = math.prod(shape) * dt.itemsize
            if offset < 0 or offset + n > base.numel():
                raise ValueError(f"an array of {n} bytes at {offset} in a buffer of {base.numel()}")
            items.append((dt, shape, offset, n))
        if not items:
            return []
        # one allocation, one peer copy and a few views: each torch call hands the GIL to the
        # decode engine's thread, which keeps it up to the interpreter's 5 ms switch interval
        # (per-array copies took 63 ms a request under load)
        total = max(offset + n for _, _, offset, n in items)
        try:
            flat = torch.empty(total, dtype=torch.uint8, device=self._device)
        except torch.cuda.OutOfMemoryError:
            # refused: the sender tries another decode instance, then ends the request saying why
            raise RuntimeError(f"no GPU memory left on the decode instance for the request's {total} bytes "
                               f"(its KV cache holds the GPU: lower --gpu-memory-utilization)") from None
        flat.copy_(base[:total])
        # freed after the engine's import on its own stream: not reused before that ran
        flat.record_stream(torch.cuda.default_stream(self._device))
        dt, shape, _, n = items[0]
        if all(it[0] == dt and it[1] == shape and it[2] == i * n for i, it in enumerate(items)):
            return list(flat[: len(items) * n].view(dt).view(len(items), *shape).unbind(0))
        return [flat[o : o + n].view(dt).view(shape) for dt, shape, o, n in items]

    def _visible(self, uuid: str) -> int:
        torch = self._torch
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                return i
        raise ValueError(f"the sender's GPU ({uuid}) is not visible to this process: list it in CUDA_VISIBLE_DEVICES, "
                         f"after this instance's own")

    def close(self) -> None:
        super().close()
        with self._lock:
            self._free.clear()
            self._lent.clear()
        self._opened.clear()

