"""TorchDevicePlatform (``fd_core.runtimes.torch.device``): a chip PyTorch addresses as a device,
detected through ``torch.<torch_device>``, with memory and collectives on torch and the emulation
mode of every device platform (``fd_core.runtimes.device``)."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch

from fd_core.interfaces import Capabilities, Communicator, Platform
from fd_core.plugins.registry import EMULATE_ENV
from fd_core.runtimes import torch as runtime
from fd_core.runtimes.torch.device import TorchDevicePlatform


class ChipPlatform(TorchDevicePlatform):
    name = "chip"
    device_type = "chip"
    torch_device = "chipdev"
    visible_devices_env = "CHIP_VISIBLE_DEVICES"
    collective_backend = "cccl"
    collective_library = "cccl"
    requirement = "torch-chip"

    def chip_capabilities(self):
        return self.manifest(("float32", "float16", "bfloat16"))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.delenv("CHIP_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def chip(monkeypatch):
    """torch with a ``torch.chipdev`` of two devices; returns the calls made to it."""
    calls = []
    module = types.SimpleNamespace(device_count=lambda: 2, set_device=lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(torch, "chipdev", module, raising=False)
    return calls


def test_is_a_platform_and_imports_no_torch():
    assert isinstance(ChipPlatform(), Platform) and ChipPlatform.runtime == "torch"
    code = "import sys, fd_core.runtimes.torch.device; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip() == "False", out.stderr


def test_unavailable_where_torch_has_no_such_device():
    ok, why = ChipPlatform().is_available()
    assert not ok and why == (f"torch {torch.__version__} is not built with the chipdev device (torch.chipdev); "
                              f"install torch-chip")
    assert ChipPlatform().capabilities().device_count == 0  # the manifest is still shown (fd backends)


def test_unavailable_where_the_extension_is_missing():
    class WithExtension(ChipPlatform):
        extension = "torch_chip_not_installed"

    assert WithExtension().is_available() == (False, "torch_chip_not_installed is not installed; install torch-chip")


def test_available_through_torch(chip):
    p = ChipPlatform()
    assert p.is_available() == (True, "") and p.device_count() == 2
    caps = p.capabilities()
    assert caps.dtypes == caps.kv_cache_dtypes == {"float32", "float16", "bfloat16"}
    assert caps.collective_library == "cccl" and caps.device_count == 2 and not caps.quantization
    assert caps.prefix_caching and caps.chunked_prefill and caps.kv_swap
    assert not caps.memory_query and not caps.memory_profiling and not caps.graph_capture
    assert p.describe_devices() == ["chipdev:0", "chipdev:1"]
    assert p.default_max_num_batched_tokens is None and p.runner_hooks() is None


def test_the_collective_library_defaults_to_the_backend_and_none_is_no_tensor_parallelism(chip):
    class BackendOnly(ChipPlatform):
        collective_library = ""

    class Single(ChipPlatform):
        collective_backend = collective_library = ""

    assert BackendOnly().capabilities().collective_library == "cccl"
    assert Single().capabilities().collective_library == "none"


def test_built_but_no_device(monkeypatch):
    monkeypatch.setattr(torch, "chipdev", types.SimpleNamespace(device_count=lambda: 0), raising=False)
    ok, why = ChipPlatform().is_available()
    assert not ok and why == (f"torch {torch.__version__} supports chip but sees no device; check the driver and "
                              f"CHIP_VISIBLE_DEVICES")


def test_a_failing_probe_is_a_reason_not_a_crash(monkeypatch):
    def broken():
        raise RuntimeError("driver version mismatch")

    monkeypatch.setattr(torch, "chipdev", types.SimpleNamespace(device_count=broken), raising=False)
    why = "the chip probe could not run (RuntimeError: driver version mismatch)"
    assert ChipPlatform().is_available() == (False, why)


def test_emulated_on_the_cpu(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "chip")
    monkeypatch.setenv("CHIP_VISIBLE_DEVICES", "0,1")
    p = ChipPlatform()
    assert p.is_available() == (True, "") and p.device_count() == 2
    # the chip's manifest narrowed to what torch runs on the CPU
    assert p.capabilities() == Capabilities(
        dtypes=frozenset({"float32", "bfloat16"}), kv_cache_dtypes=frozenset({"float32", "bfloat16"}),
        quantization=frozenset(), graph_capture=False, prefix_caching=True, chunked_prefill=True, kv_swap=True,
        collective_library="gloo", pinned_host_memory=False, device_count=2, memory_query=True,
        memory_profiling=False, speculative_methods=frozenset({"ngram", "draft_model", "mtp"}))
    memory = p.memory(1)
    assert isinstance(memory, runtime.TorchMemory) and memory.device == "cpu"
    free, total = memory.memory_info()
    assert 0 < free <= total
    assert p.describe_devices()[1] == "chip 1 (emulated on the CPU: FD_EMULATE)"
    assert p.default_max_num_batched_tokens == 48 and p.default_long_prefill_token_threshold == 24


def test_memory_on_the_chip_sets_the_device(monkeypatch, chip):
    made = []
    monkeypatch.setattr(runtime, "TorchMemory", lambda device: made.append(device) or device)
    assert ChipPlatform().memory(1) == "chipdev:1"
    assert made == ["chipdev:1"] and chip == [("set_device", 1)]


def _record_init(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "init_process_group",
                        lambda rank, world_size, rendezvous, backend=None: calls.append(
                            (rank, world_size, rendezvous, backend)))
    return calls


def test_communicator_joins_the_chips_collective_backend(monkeypatch, chip):
    calls = _record_init(monkeypatch)
    comm = ChipPlatform().communicator(rank=3, world_size=4, rendezvous="127.0.0.1:1,2,3,4")
    assert isinstance(comm, Communicator) and (comm.rank, comm.world_size) == (3, 4)
    assert calls == [(3, 4, "127.0.0.1:1,2,3,4", "cccl")]
    assert chip == [("set_device", 1)]  # rank 3 of 2 devices


def test_communicator_single_rank_joins_nothing(monkeypatch, chip):
    calls = _record_init(monkeypatch)
    comm = ChipPlatform().communicator()
    assert calls == [] and chip == [] and (comm.rank, comm.world_size) == (0, 1)


def test_emulated_communicator_uses_gloo(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "chip")
    calls = _record_init(monkeypatch)
    ChipPlatform().communicator(rank=1, world_size=2, rendezvous="127.0.0.1:5,6")
    assert calls == [(1, 2, "127.0.0.1:5,6", "gloo")]
