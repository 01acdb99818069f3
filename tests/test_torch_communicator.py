"""TorchCommunicator: the Communicator protocol over torch.distributed (CPU, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from fd_core.interfaces.communicator import Communicator
from fd_core.runtimes.torch import TorchCommunicator, init_process_group


def test_communicator_rejects_bad_ranks_and_lists():
    with pytest.raises(ValueError):
        TorchCommunicator(rank=1, world_size=1)
    with pytest.raises(ValueError):
        TorchCommunicator(rank=-1, world_size=2)
    with pytest.raises(ValueError):
        TorchCommunicator().all_to_all([torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError):
        init_process_group(2, 2, "127.0.0.1:1,2")
    with pytest.raises(ValueError):
        init_process_group(0, 2, "no-port")


def test_world_size_one_is_identity():
    comm = TorchCommunicator()
    assert isinstance(comm, Communicator)
    assert (comm.rank, comm.world_size) == (0, 1)
    x = torch.arange(6.0).reshape(2, 3)
    assert comm.all_reduce(x) is x
    assert comm.all_gather(x, axis=0) is x
    assert comm.all_gather(x) is x
    assert comm.broadcast(x, src=0) is x
    ys = comm.all_to_all([x])
    assert len(ys) == 1 and ys[0] is x
    comm.barrier()
    with pytest.raises(RuntimeError, match="world_size 1"):
        comm.send(x, dst=0)
    with pytest.raises(RuntimeError, match="world_size 1"):
        comm.recv(x, src=0)


WORKER = r"""
import json
import sys
import torch
import torch.distributed as dist
from fd_core.runtimes.torch import TorchCommunicator, init_process_group

rank, size, rendezvous, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
init_process_group(rank, size, rendezvous)
assert dist.get_backend() == "gloo"
comm = TorchCommunicator(rank, size)
f32 = lambda *v: torch.tensor(v, dtype=torch.float32)
rows = f32(rank, rank + 0.5).reshape(1, 2)
out = {
    "all_reduce": comm.all_reduce(f32(rank + 1.0, 10.0)).tolist(),
    "all_gather0": comm.all_gather(rows, axis=0).tolist(),
    "all_gather-1": comm.all_gather(rows, axis=-1).tolist(),
    "broadcast": comm.broadcast(f32(rank * 5.0), src=1).tolist(),
    "all_to_all": [t.tolist() for t in comm.all_to_all([f32(10.0 * rank + j) for j in range(size)])],
}
# The fallback for gloo builds without all_to_all: gather every rank's stacked list.
real = dist.all_to_all
def unsupported(*args, **kwargs):
    raise RuntimeError("ProcessGroupGloo does not support alltoall")
dist.all_to_all = unsupported
out["all_to_all_fallback"] = [
    t.tolist() for t in comm.all_to_all([f32(10.0 * rank + j, -1.0) for j in range(size)])
]
dist.all_to_all = real
if rank == 0:
    comm.send(f32(42.0, 43.0), dst=1)
else:
    out["recv"] = comm.recv(torch.zeros(2), src=0).tolist()
comm.barrier()
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_two_cpu_ranks_over_gloo(tmp_path):
    from fd_core.engine.executor import rendezvous_address

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    rendezvous = rendezvous_address(2)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", rendezvous, str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=60)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            logs.append(proc.communicate()[0])
    results = {
        rank: json.loads((tmp_path / f"rank{rank}.json").read_text())
        for rank in (0, 1)
        if (tmp_path / f"rank{rank}.json").exists()
    }
    assert set(results) == {0, 1}, "\n".join(log[-2000:] for log in logs)
    for rank, out in results.items():
        assert out["all_reduce"] == [3.0, 20.0]
        assert out["all_gather0"] == [[0.0, 0.5], [1.0, 1.5]]
        assert out["all_gather-1"] == [[0.0, 0.5, 1.0, 1.5]]
        assert out["broadcast"] == [5.0]
        assert out["all_to_all"] == [[rank + 0.0], [10.0 + rank]]
        assert out["all_to_all_fallback"] == [[rank + 0.0, -1.0], [10.0 + rank, -1.0]]
    assert results[1]["recv"] == [42.0, 43.0]
    assert all(proc.returncode == 0 for proc in procs), "\n".join(log[-2000:] for log in logs)
