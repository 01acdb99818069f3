"""PaddleCommunicator: the Communicator protocol over ``paddle.distributed``."""

from __future__ import annotations

import os

import paddle
import paddle.distributed as dist

from fd_core.runtimes.ranks import RankedGroup, parse_rendezvous

Tensor = paddle.Tensor


def init_process_group(rank: int, world_size: int, rendezvous: str, backend: str = "gloo") -> None:
    """Join ``paddle.distributed``'s process group as ``rank``: the environment its launcher
    would set, then ``init_parallel_env``. ``rendezvous`` is ``host:port,port,...`` (one port
    per rank: Paddle gives every rank an endpoint)."""
    host, ports = parse_rendezvous(rendezvous, world_size)
    endpoints = [f"{host}:{p}" for p in ports[:world_size]]
    os.environ.update(
        PADDLE_TRAINER_ID=str(rank), PADDLE_TRAINERS_NUM=str(world_size),
        PADDLE_TRAINER_ENDPOINTS=",".join(endpoints), PADDLE_CURRENT_ENDPOINT=endpoints[rank],
        PADDLE_RANK_IN_NODE=str(rank), PADDLE_LOCAL_SIZE=str(world_size), PADDLE_DISTRI_BACKEND=backend,
    )
    dist.init_parallel_env()


class PaddleCommunicator(RankedGroup):
    """Collectives among the ``world_size`` ranks of one model instance.

    ``world_size == 1``: every collective is the identity and send/recv raise, so no distributed
    environment is needed. ``world_size > 1``: the caller must have initialised
    ``paddle.distributed`` (``dist.init_parallel_env()`` or a launcher) before the first
    collective; this class never initialises it. ``group`` (a ``dist.new_group`` result) restricts
    the collectives to its ranks, and ``rank``/``src``/``dst`` are then positions in that group.

    ``all_reduce`` and ``broadcast`` work in place where Paddle does: use the returned tensor and
    treat the argument as consumed.
    """

    def _global(self, rank: int) -> int:
        # Paddle names peers by global rank; our callers count within the group.
        return rank if self.group is None else self.group.ranks[rank]

    def all_reduce(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor, axis: int = -1) -> Tensor:
        if self.world_size == 1:
            return tensor
        parts: list[Tensor] = []
        dist.all_gather(parts, tensor, group=self.group)
        return paddle.concat(parts, axis=axis)

    def all_to_all(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors[j]`` goes to rank ``j``. What arrives from rank ``j`` is allocated like
        ``tensors[j]`` (Paddle's rule), so each pair of ranks must agree on shape and dtype; on
        the CPU every tensor must have the same shape."""
        if len(tensors) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} tensors, got {len(tensors)}")
        if self.world_size == 1:
            return list(tensors)
        if tensors[0].place.is_cpu_place():
            # Gloo, the CPU backend, has no all_to_all: gather every rank's whole list and keep
            # our column (world_size times the traffic; CPU ranks are few).
            stacks: list[Tensor] = []
            dist.all_gather(stacks, paddle.stack(tensors), group=self.group)
            return [stack[self.rank] for stack in stacks]
        received: list[Tensor] = []
        dist.alltoall(received, list(tensors), group=self.group)
        return received

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        if self.world_size > 1:
            dist.broadcast(tensor, src=self._global(src), group=self.group)
        return tensor

    def send(self, tensor: Tensor, dst: int) -> None:
        self._check_peer(dst, "send")
        dist.send(tensor, dst=self._global(dst), group=self.group)

    def recv(self, tensor: Tensor, src: int) -> Tensor:
        self._check_peer(src, "recv")
        dist.recv(tensor, src=self._global(src), group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
