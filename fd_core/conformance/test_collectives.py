"""The platform's Communicator across two ranks, each in its own process, joined the way an
engine's tensor-parallel workers join (``Platform.communicator(rank, world_size, rendezvous)``):
every collective of the contract gives every rank the right numbers, and none hangs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from fd_core.engine.executor import rendezvous_address
from fd_core.plugins.registry import emulated
from fd_core.testing.collectives import expected

WORLD_SIZE = 2
TIMEOUT_S = 180.0


def test_two_ranks_run_every_collective(fd_backend, tmp_path):
    fd_backend.require()
    p = fd_backend.platform
    devices = p.device_count()
    if devices < WORLD_SIZE:
        visible = getattr(p, "visible_devices_env", "")
        hint = f" (emulated, list {WORLD_SIZE} in {visible})" if visible and emulated(p.name) else ""
        pytest.skip(f"the collectives need {WORLD_SIZE} devices; {p.name} has {devices}{hint}")
    dtype = fd_backend.dtype
    rendezvous = rendezvous_address(WORLD_SIZE)
    outs = [tmp_path / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "fd_core.testing.collectives", p.name, fd_backend.runtime or "", str(rank),
             str(WORLD_SIZE), rendezvous, dtype, str(outs[rank])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(WORLD_SIZE)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    logs = []
    for rank, proc in enumerate(procs):
        try:
            logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            tails = "\n".join(f"rank {r} output:\n{(other.communicate()[0] or '')[-1500:]}"
                              for r, other in enumerate(procs))
            pytest.fail(f"{p.name}: the {WORLD_SIZE} ranks did not finish within {TIMEOUT_S:.0f} s "
                        f"(rendezvous {rendezvous}): a collective or the group's start hangs\n{tails}")
    for rank in range(WORLD_SIZE):
        if not outs[rank].exists():
            pytest.fail(f"{p.name}: rank {rank} exited with status {procs[rank].returncode} before reporting:\n"
                        f"{logs[rank][-3000:]}")
        got = json.loads(outs[rank].read_text())
        assert "error" not in got, f"{p.name}: rank {rank} of {WORLD_SIZE} failed: {got['error']}\n{got['traceback']}"
        assert (got["rank"], got["world_size"]) == (rank, WORLD_SIZE), \
            f"{p.name}: rank {rank}'s communicator says it is rank {got['rank']} of {got['world_size']}"
        for op, want in expected(rank, WORLD_SIZE).items():
            assert got[op] == want, f"{p.name}, {dtype}: {op} on rank {rank} of {WORLD_SIZE} gave {got[op]}, expected {want}"
