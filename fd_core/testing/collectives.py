"""One rank of the kit's collectives test: ``python -m fd_core.testing.collectives DEVICE
RUNTIME RANK WORLD_SIZE RENDEZVOUS DTYPE OUT``.

The rank joins its group the way an engine's tensor-parallel worker does (the platform's
``communicator``, then its ``memory`` for the rank's device), runs every collective of the
Communicator contract on small tensors, and writes what it got, or the error, to OUT as JSON.
``expected`` says what each rank must get; the values are small integers, exact in every dtype.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import numpy as np


def inputs(rank: int, world_size: int) -> dict[str, Any]:
    """What rank ``rank`` contributes to each collective."""
    return {
        "all_reduce": [[rank + 1, 10], [2 * rank, 3]],
        "all_gather_rows": [[rank, rank]],
        "all_gather_columns": [[rank], [rank + 10]],
        "broadcast": [rank * 5 + 1],
        "all_to_all": [[10 * rank + j] for j in range(world_size)],
    }


def expected(rank: int, world_size: int) -> dict[str, Any]:
    """What rank ``rank`` must get from each collective."""
    ranks = range(world_size)
    out: dict[str, Any] = {
        "all_reduce": [[sum(r + 1 for r in ranks), 10 * world_size], [sum(2 * r for r in ranks), 3 * world_size]],
        "all_gather(axis=0)": [[r, r] for r in ranks],
        "all_gather(axis=-1)": [list(ranks), [r + 10 for r in ranks]],
        "broadcast(src=last)": [(world_size - 1) * 5 + 1],
        "all_to_all": [[10 * j + rank] for j in ranks],
    }
    if rank == 0:
        out["recv(src=1)"] = [7]
    if rank == 1:
        out["recv(src=0)"] = [42, 43]
    return out


def run(device: str, runtime: str | None, rank: int, world_size: int, rendezvous: str, dtype: str) -> dict[str, Any]:
    from fd_core.plugins import get_registry

    platform = get_registry().platform(device, runtime)
    comm = platform.communicator(rank, world_size, rendezvous)
    memory = platform.memory(rank % max(1, platform.device_count()))
    given = inputs(rank, world_size)

    def tensor(values: Any) -> Any:
        return memory.from_numpy(np.asarray(values, dtype=np.float32), dtype)

    def back(t: Any) -> Any:
        return memory.to_numpy(t).astype(np.float64).tolist()

    got: dict[str, Any] = {"rank": comm.rank, "world_size": comm.world_size}
    got["all_reduce"] = back(comm.all_reduce(tensor(given["all_reduce"])))
    got["all_gather(axis=0)"] = back(comm.all_gather(tensor(given["all_gather_rows"]), axis=0))
    got["all_gather(axis=-1)"] = back(comm.all_gather(tensor(given["all_gather_columns"]), axis=-1))
    got["broadcast(src=last)"] = back(comm.broadcast(tensor(given["broadcast"]), src=world_size - 1))
    got["all_to_all"] = [back(t) for t in comm.all_to_all([tensor(v) for v in given["all_to_all"]])]
    # both directions, so that neither rank only ever sends
    if rank == 0:
        comm.send(tensor([42, 43]), dst=1)
        got["recv(src=1)"] = back(comm.recv(tensor([0]), src=1))
    elif rank == 1:
        got["recv(src=0)"] = back(comm.recv(tensor([0, 0]), src=0))
        comm.send(tensor([7]), dst=0)
    comm.barrier()
    return got


def main(argv: list[str]) -> int:
    device, runtime, rank, world_size, rendezvous, dtype, out = argv
    try:
        result = run(device, runtime or None, int(rank), int(world_size), rendezvous, dtype)
    except BaseException as exc:  # noqa: BLE001 - the parent reports it, naming the rank
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
