"""TorchCommunicator: the Communicator protocol over ``torch.distributed``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fd_core.runtimes.ranks import RankedGroup, parse_rendezvous

Tensor = torch.Tensor


def init_process_group(rank: int, world_size: int, rendezvous: str, backend: str | None = None) -> None:
    """Join ``torch.distributed``'s default process group as ``rank``.

    ``rendezvous`` is ``host:port,port,...`` (one port per rank); torch needs only the first,
    where rank 0 serves the TCP store (``init_method="tcp://host:firstport"``). ``backend``
    defaults to ``"gloo"`` (CPU tensors); ``"nccl"`` (CUDA tensors) is used only when
    ``torch.cuda.is_available()`` (else gloo) and also selects this rank's local CUDA device,
    ``rank % device_count``. Any other backend name is passed to torch as given.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    host, ports = parse_rendezvous(rendezvous, world_size)
    backend = backend or "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        backend = "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend, init_method=f"tcp://{host}:{ports[0]}", rank=rank, world_size=world_size
    )


class TorchCommunicator(RankedGroup):
    """Collectives among the ``world_size`` ranks of one model instance.

    ``world_size == 1``: every collective is the identity and send/recv raise, so no distributed
    environment is needed. ``world_size > 1``: the caller must have initialised
    ``torch.distributed`` (``init_process_group`` above or a launcher) before the first
    collective; this class never initialises it. ``group`` (a ``dist.new_group`` result) restricts
    the collectives to its ranks, and ``rank``/``src``/``dst`` are then positions in that group.

    ``all_reduce``, ``broadcast`` and ``recv`` work in place: use the returned tensor and treat
    the argument as consumed. Tensors must live where the backend expects them (CPU for gloo,
    the rank's CUDA device for nccl).
    """

    def _global(self, rank: int) -> int:
        # torch.distributed names peers by global rank; our callers count within the group.
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_reduce(self, tensor: Tensor) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor, axis: int = -1) -> Tensor:
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=axis)

    def all_to_all(self, tensors: list[Tensor]) -> list[Tensor]:
        """``tensors[j]`` goes to rank ``j``. What arrives from rank ``j`` is allocated like
        ``tensors[j]``, so each pair of ranks must agree on shape and dtype. On a gloo build
        without all_to_all, CPU tensors fall back to gathering every rank's stacked list (then
        every tensor must have the same shape)."""
        if len(tensors) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} tensors, got {len(tensors)}")
        if self.world_size == 1:
            return list(tensors)
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        try:
            dist.all_to_all(received, sent, group=self.group)
        except (RuntimeError, NotImplementedError):
            # Older gloo has no all_to_all; it fails on every rank before any traffic, so all
            # ranks take this path together (world_size times the traffic; CPU ranks are few).
            if sent[0].device.type != "cpu":
                raise
            return self._all_to_all_by_gather(sent)
        return received

    def _all_to_all_by_gather(self, tensors: list[Tensor]) -> list[Tensor]:
        stacked = torch.stack(tensors)
        stacks = [torch.empty_like(stacked) for _ in range(self.world_size)]
        dist.all_gather(stacks, stacked, group=self.group)
        return [stack[self.rank] for stack in stacks]

    def broadcast(self, tensor: Tensor, src: int = 0) -> Tensor:
        if self.world_size > 1:
            if not 0 <= src < self.world_size:
                raise ValueError(f"broadcast: rank {src} is outside world_size {self.world_size}")
            dist.broadcast(tensor, src=self._global(src), group=self.group)
        return tensor

    def send(self, tensor: Tensor, dst: int) -> None:
        self._check_peer(dst, "send")
        dist.send(tensor.contiguous(), dst=self._global(dst), group=self.group)

    def recv(self, tensor: Tensor, src: int) -> Tensor:
        self._check_peer(src, "recv")
        dist.recv(tensor, src=self._global(src), group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
