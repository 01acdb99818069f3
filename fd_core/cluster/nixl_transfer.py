"""``nixl``: the KV-cache connector over NVIDIA's NIXL (``pip install nixl-cu12``, or ``nixl``),
the transfer library vLLM's and Dynamo's disaggregated serving use.

The control messages are the ``tcp`` connector's (ZeroMQ: the request's header, its arrays'
layout); the arrays themselves move through NIXL, one-sided: the prefill side registers its
staged arrays with its NIXL agent and sends their addresses with its agent's metadata, the
decode side registers arrays of its own and READs into them (UCX picks the path: shared memory
or TCP on one host, RDMA where the hosts have it), then acknowledges, and the prefill side lets
its arrays go. Host memory (DRAM) only, as the contract stages it.
"""

from __future__ import annotations

import importlib
import time
import uuid

import msgspec
import numpy as np
import zmq

from fd_core.cluster.tcp_transfer import TcpTransfer
from fd_core.errors import ConfigError

READ_TIMEOUT_S = 30.0
# the NIXL Python packages: the meta package and its CUDA-specific builds (each runs on host
# memory without a GPU)
_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")


def nixl_api():
    """NIXL's Python API, or ConfigError saying how to install it."""
    for name in _MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError("--cache-transfer-protocol nixl: NIXL is not installed (pip install nixl-cu12, or nixl)")


class NixlTransfer(TcpTransfer):
    name = "nixl"

    def __init__(self, timeout: float = 30.0) -> None:
        self._api = nixl_api()
        self._agent = None  # made on the connector's thread, which alone uses it
        self._name = f"fd-{uuid.uuid4().hex[:12]}"
        self._registered: dict[str, tuple[object, list]] = {}  # request id -> (registration, frames) until acknowledged
        self._peers: set[str] = set()
        super().__init__(timeout)

    def _nixl(self):
        if self._agent is None:
            self._agent = self._api.nixl_agent(self._name, self._api.nixl_agent_config(backends=["UCX"]))
        return self._agent

    def _outgoing(self, request_id: str, arrays: list[zmq.Frame]) -> list:
        agent = self._nixl()
        regions = [(_address(f.buffer), len(f.buffer), 0) for f in arrays]
        registration = agent.register_memory([(*r, "") for r in regions], mem_type="DRAM")
        self._registered[request_id] = (registration, arrays)  # the frames keep the arrays alive
        return [agent.get_agent_metadata(), msgspec.msgpack.encode(regions)]

    def _release(self, request_id: str) -> None:
        entry = self._registered.pop(request_id, None)
        if entry is not None:
            self._nixl().deregister_memory(entry[0])

    def _incoming(self, layout: list, frames: list[zmq.Frame]) -> list[np.ndarray]:
        if len(frames) != 2:
            raise ValueError("a nixl transfer carries its sender's metadata and its arrays' addresses")
        agent = self._nixl()
        remote = msgspec.msgpack.decode(frames[1].bytes)
        if len(remote) != len(layout):
            raise ValueError(f"{len(remote)} regions for a layout of {len(layout)}")
        peer = agent.add_remote_agent(frames[0].bytes)
        peer = peer.decode() if isinstance(peer, bytes) else peer
        self._peers.add(peer)
        arrays = [np.empty(shape, dtype=np.dtype(dtype)) for dtype, shape in layout]
        local = [(a.ctypes.data, a.nbytes, 0) for a in arrays]
        if [n for _, n, _ in local] != [n for _, n, _ in remote]:
            raise ValueError("the sender's regions do not match its layout")
        registration = agent.register_memory([(*r, "") for r in local], mem_type="DRAM")
        try:
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                           agent.get_xfer_descs([tuple(r) for r in remote], "DRAM"), peer)
            state, deadline = agent.transfer(handle), time.monotonic() + READ_TIMEOUT_S
            while state == "PROC" and time.monotonic() < deadline:
                state = agent.check_xfer_state(handle)
            agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"the NIXL read from {peer} ended in state {state}")
        finally:
            agent.deregister_memory(registration)
        return arrays

    def close(self) -> None:
        super().close()
        self._registered.clear()


def _address(buffer: memoryview) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data
