"""Communicator: the collectives between the ranks of one model instance."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fd_core.interfaces.memory import Tensor


@runtime_checkable
class Communicator(Protocol):
    """Collectives over the ``world_size`` ranks that together hold one model.

    With ``world_size == 1`` every collective is the identity (and send/recv are errors), so
    shared model code may call them unconditionally.
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sum over ranks; every rank gets the result."""
        ...

    def all_gather(self, tensor: Tensor, axis: int = -1) -> Tensor:
        """Concatenate every rank's tensor along ``axis`` in rank order."""
        ...

    def all_to_all(self, tensors: list[Tensor]) -> list[Tensor]:
        """Rank ``r`` sends ``tensors[j]`` to rank ``j`` and receives rank ``j``'s ``tensors[r]``."""
        ...

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        """Every rank gets rank ``src``'s tensor."""
        ...

    def send(self, tensor: Tensor, dst: int) -> None: ...

    def recv(self, tensor: Tensor, src: int) -> Tensor:
        """Receive into a tensor of the expected shape and dtype; returns it."""
        ...

    def barrier(self) -> None: ...
