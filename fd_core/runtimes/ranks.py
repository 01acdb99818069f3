"""What every runtime's Communicator shares: its place in a group of ranks, and the checks on it
(no tensor library here)."""

from __future__ import annotations

from typing import Any


class RankedGroup:
    """``rank`` of ``world_size``, optionally within a runtime ``group`` (positions then count
    within it)."""

    def __init__(self, rank: int = 0, world_size: int = 1, group: Any | None = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def _check_peer(self, peer: int, what: str) -> None:
        if self.world_size == 1:
            raise RuntimeError(f"{what} needs another rank, but this communicator has world_size 1")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{what}: rank {peer} is outside world_size {self.world_size}")


def parse_rendezvous(rendezvous: str | None, world_size: int) -> tuple[str, list[int]]:
    """``(host, ports)`` of a rendezvous ``"host:port,port,..."`` (one port per rank)."""
    host, sep, ports = (rendezvous or "").rpartition(":")
    try:
        numbers = [int(p) for p in ports.split(",") if p]
    except ValueError:
        numbers = []
    if not sep or not host or len(numbers) < world_size:
        raise ValueError(f"rendezvous {rendezvous!r} is not 'host:port,...' with {world_size} ports")
    return host, numbers
