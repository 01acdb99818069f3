"""KVTransfer: how a request's keys and values travel from a prefill instance to a decode
instance (prefill/decode disaggregation, ``--role prefill|decode``).

The engine stages a request's KV blocks in host memory (the Memory's ``swap_blocks`` into a
host cache of their size, then NumPy arrays: a key and a value array per layer, per
tensor-parallel rank) and hands them to a connector with a small header of its own; the
connector moves them to the decode instance's connector, which hands them to its engine. A
backend package registers connectors by name through the ``fd_kv_transfers`` hook (API 1.14),
e.g. an RDMA transport between its chips' hosts; fd-core ships ``tcp`` (ZeroMQ over TCP),
which works between any two hosts that reach each other. ``--cache-transfer-protocol`` names
the one an instance uses; both ends of a transfer must use the same.

Neither end blocks its engine: ``send`` queues, ``completed`` and ``received`` return what
finished since the last call.

A connector that moves device memory instead (API 1.16) says so with ``device``, the platform
name whose Memory tensors it takes (e.g. ``"cuda"``): the engine then hands it a device copy of
the blocks (the Memory's tensors, same shapes and dtypes, no host staging), and the decode
side's ``received`` gives tensors of that Memory, on the receiving engine's device, or host
arrays as above where it had to stage them. An instance whose platform is another, or that
runs tensor-parallel ranks in other processes, stops at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np


class KVTransferError(Exception):
    """A transfer could not be started (bad endpoint, connector closed)."""


@dataclass
class TransferDone:
    """A send that ended: acknowledged by the receiving connector (``error`` empty), or not
    (``error`` says why: no answer in time, refused)."""

    request_id: str
    nbytes: int
    seconds: float  # from send() to the receiver's acknowledgement (or to the failure)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Received:
    """A transfer that arrived: the sender's header and arrays, as sent."""

    request_id: str
    header: bytes
    arrays: list[np.ndarray] = field(repr=False)
    nbytes: int = 0


@runtime_checkable
class KVTransfer(Protocol):
    name: str
    # optional (1.16): the platform whose device tensors the connector moves; absent or "" for
    # host arrays
    # device: str

    def listen(self, host: str, port: int = 0) -> str:
        """Start receiving on ``host`` (``port`` 0: any free one); returns the endpoint that
        senders pass to ``send`` (a decode instance announces it to the cluster)."""
        ...

    def send(self, endpoint: str, request_id: str, header: bytes, arrays: list[np.ndarray]) -> None:
        """Queue ``arrays`` (C-contiguous; the connector may read them until the transfer is
        done) and ``header`` for the connector listening at ``endpoint``. Does not wait for
        the peer; KVTransferError where the transfer cannot even be queued."""
        ...

    def completed(self) -> list[TransferDone]:
        """Sends that ended since the last call."""
        ...

    def received(self) -> list[Received]:
        """Transfers that arrived since the last call (already acknowledged to their sender)."""
        ...

    def close(self) -> None:
        ...


# what the fd_kv_transfers hook returns, by name: called with the seconds a send may wait for
# its acknowledgement before it counts as failed
KVTransferFactory = Callable[[float], KVTransfer]
