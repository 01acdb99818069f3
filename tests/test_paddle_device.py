"""The shared base of the vendor backends on the Paddle runtime (fd_core.runtimes.paddle.device)
and the adapters over Paddle's fused kernels (fd_core.runtimes.paddle.fused)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from fd_core.interfaces import Capabilities, Communicator, Platform
from fd_core.plugins import OpRegistry
from fd_core.plugins.ops import op_context
from fd_core.runtimes import paddle as runtime
from fd_core.runtimes.paddle import REFERENCE_OPS, fused
from fd_core.runtimes.paddle.device import EMULATE_ENV, PaddleDevicePlatform, emulated
from fd_core.testing import spec
from fd_core.testing.spec import TOLERANCES


def pd(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(a)


# Paddle 3.3.1's CPU fused_rms_norm dies with SIGILL on CPUs without AVX-512 (an AVX2-only AMD
# EPYC; QEMU's Haswell, whose /proc/cpuinfo shows the host's flags): there the probe declines it,
# and this process must not run it.
DIES = "fused_rms_norm killed its probe process with SIGILL"


def require_cpu_rms_norm() -> None:
    ok, why = fused.probe("rms_norm", "cpu")
    if why.startswith(DIES):
        pytest.skip(f"fused_rms_norm cannot run on this CPU: {why}")
    assert ok, why


# --- the adapters against the spec, on the CPU place where the kernel exists ------------------


@pytest.mark.parametrize("shape", [(5, 64), (2, 3, 32), (1, 8)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_adapter_matches_spec(shape, with_residual):
    require_cpu_rms_norm()
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32) if with_residual else None
    got = fused.rms_norm(pd(x), pd(w), 1e-5, None if r is None else pd(r))
    want = spec.rms_norm(x, w, 1e-5, r)
    if with_residual:
        assert isinstance(got, tuple) and len(got) == 2
        for g, s in zip(got, want):
            np.testing.assert_allclose(g.numpy(), s, **TOLERANCES["rms_norm"])
            assert g.dtype == paddle.float32
    else:
        np.testing.assert_allclose(got.numpy(), want, **TOLERANCES["rms_norm"])


@pytest.mark.parametrize("shape", [(4, 64), (1, 2), (7, 96)])
def test_silu_and_mul_adapter_matches_spec(shape):
    assert fused.available("silu_and_mul", "cpu")
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32) * 4
    np.testing.assert_allclose(fused.silu_and_mul(pd(x)).numpy(), spec.silu_and_mul(x), **TOLERANCES["silu_and_mul"])


def test_probe_says_which_kernels_cpu_paddle_lacks():
    # CPU Paddle 3.3.1: no fused rope; the CPU kernels are float32 only
    assert not fused.available("rotary", "cpu")
    ok, why = fused.probe("rotary", "cpu")
    assert not ok and "fused_rotary_position_embedding" in why
    assert not fused.available("rms_norm", "cpu", "bfloat16")
    report = fused.probe_report("cpu")
    assert report["swiglu"]["float32"] == "ok"
    assert report["fused_rms_norm"]["float32"] == "ok" or report["fused_rms_norm"]["float32"].startswith(DIES)
    with pytest.raises(ValueError, match="no fused kernel probe"):
        fused._probe_case("attention", "cpu", "float32")


def _paddle_rope(q, k, v, sin, cos, position_ids, use_neox_rotary_style, time_major):
    """A stand-in for fused_rotary_position_embedding where Paddle has no kernel (the CPU),
    written from the GPU kernel's definition (Paddle's paddle/phi/kernels/fusion/gpu/
    fused_rope_utils.h): out[d] = x[d] * cos[d] + rotate(x)[d] * sin[d], rotate pairing adjacent
    dims when use_neox_rotary_style, else the two halves; cos/sin [1, S, 1, D]."""
    assert position_ids is None and not time_major and v is None
    c, s = cos.numpy(), sin.numpy()

    def apply(x):
        x = x.numpy()
        d = x.shape[-1]
        rotated = np.empty_like(x)
        if use_neox_rotary_style:
            rotated[..., 0::2], rotated[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        else:
            rotated[..., : d // 2], rotated[..., d // 2:] = -x[..., d // 2:], x[..., : d // 2]
        return paddle.to_tensor((x * c + rotated * s).astype(x.dtype))

    return apply(q), apply(k), None


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("head_dim,rot", [(16, 16), (16, 8), (12, 4)])
def test_rotary_adapter_maps_the_contract_onto_the_kernel(monkeypatch, style, head_dim, rot):
    """The adapter's layout (cos/sin per rotated dim, Paddle's inverted style names, partial
    rotary, GQA) against the spec, through a stand-in of the kernel: CPU Paddle has none."""
    monkeypatch.setattr(fused.IF, "fused_rotary_position_embedding",
                        lambda q, k, v, sin, cos, position_ids, use_neox_rotary_style, time_major:
                        _paddle_rope(q, k, v, sin, cos, position_ids, use_neox_rotary_style, time_major))
    rng = np.random.default_rng(3)
    n, hq, hk, max_pos = 5, 4, 2, 11
    inv_freq = 1.0 / 10000 ** (np.arange(0, rot, 2) / rot)
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    positions = np.array([0, 3, 10, 7, 3], np.int64)
    q = rng.standard_normal((n, hq, head_dim)).astype(np.float32)
    k = rng.standard_normal((n, hk, head_dim)).astype(np.float32)
    got_q, got_k = fused.rotary(pd(positions), pd(q), pd(k), pd(cos_sin), style)
    want_q, want_k = spec.rotary(positions, q, k, cos_sin, style)
    assert got_q.shape == list(q.shape) and got_k.shape == list(k.shape)
    np.testing.assert_allclose(got_q.numpy(), want_q, **TOLERANCES["rotary"])
    np.testing.assert_allclose(got_k.numpy(), want_k, **TOLERANCES["rotary"])


def test_rotary_adapter_rejects_unknown_style():
    with pytest.raises(ValueError, match="unknown rotary style"):
        fused.rotary(pd(np.zeros(1, np.int64)), pd(np.zeros((1, 1, 4), np.float32)),
                     pd(np.zeros((1, 1, 4), np.float32)), pd(np.zeros((1, 4), np.float32)), "gptj")


def test_register_fused_declines_where_the_kernel_is_missing():
    require_cpu_rms_norm()
    registry = OpRegistry()
    registry.register_reference("paddle", REFERENCE_OPS)
    fused.register_fused(registry, "chip", lambda: "cpu")
    registry.use_reference("chip", "paddle")
    for impl in (i for op in fused.FUSED_OPS for i in registry.implementations(op, "chip")):
        assert impl.runtime == "paddle" and impl.priority == 10
    table = registry.select("chip", "paddle", op_context("float32", 64))
    chosen = {op: c.impl.name for op, c in table.choices.items()}
    assert chosen["rms_norm"] == "fused_rms_norm"
    assert chosen["silu_and_mul"] == "swiglu"
    assert chosen["rotary"] == "reference"  # fused_rope declined: no fused rope on the CPU place
    # with the probe's reason (what fd doctor shows)
    assert ("declined: fused_rope: supports() declined this configuration: probed on cpu for float32: "
            in table.choices["rotary"].reason and "fused_rotary_position_embedding" in table.choices["rotary"].reason)
    assert table.rms_norm is fused.rms_norm
    # outside what the kernels do: another dtype, an odd head size
    half = registry.select("chip", "paddle", op_context("bfloat16", 64))
    assert half.choices["rms_norm"].impl.name == "reference"
    rotary_impl = registry.implementations("rotary", "chip")[0]
    assert not rotary_impl.supports(dtype="float32", head_dim=7)
    assert rotary_impl.accepts({"dtype": "float32", "head_dim": 7})[1].endswith("head size 7 is odd")
    # a torch engine never sees them
    assert registry.implementations("rms_norm", "chip", "torch") == []


# --- the CPU place: the kernels run in a child process ------------------------------------------


def dies_with_sigill(op, place, dtype):
    """A probe case standing for a kernel this CPU cannot run (fused.CHILD_CASE_OVERRIDES): in
    float32 it kills its process with SIGILL, as Paddle's fused_rms_norm does on a CPU without
    AVX-512; other dtypes have no CPU kernel, which the real case finds."""
    if dtype != "float32":
        return fused._probe_case(op, place, dtype)
    os.kill(os.getpid(), signal.SIGILL)


@pytest.fixture
def fresh_probe(monkeypatch, tmp_path):
    """No probe results in this process, and a cross-process cache of this test's own."""
    monkeypatch.setattr(fused, "_PROBED", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fd" / "fused_probe.json"


def test_a_cpu_kernel_that_kills_its_probe_process_is_declined_with_the_signal(monkeypatch, fresh_probe, caplog):
    monkeypatch.setitem(fused.CHILD_CASE_OVERRIDES, "rms_norm", f"{__name__}:dies_with_sigill")
    monkeypatch.setattr(fused, "_cpu_flags", lambda: frozenset({"fpu", "sse2", "avx", "avx2", "fma"}))
    runs = []
    run_child = fused._run_child
    monkeypatch.setattr(fused, "_run_child", lambda place, cases: runs.append(list(cases)) or run_child(place, cases))
    registry = OpRegistry()
    registry.register_reference("paddle", REFERENCE_OPS)
    fused.register_fused(registry, "chip", lambda: "cpu")
    registry.use_reference("chip", "paddle")
    with caplog.at_level("WARNING", logger="fd.paddle.fused"):
        table = registry.select("chip", "paddle", op_context("float32", 64))
    # this process survived; the kernel is declined with the signal and the CPU's lack of AVX-512
    ok, why = fused.probe("rms_norm", "cpu")
    assert not ok
    assert why == ("fused_rms_norm killed its probe process with SIGILL (Illegal instruction); this CPU "
                   "has no AVX-512 (no avx512f among its flags in /proc/cpuinfo)")
    assert [r.getMessage() for r in caplog.records] == [f"fused kernel fused_rms_norm declined on cpu for float32: {why}"]
    assert table.choices["rms_norm"].impl.name == "reference"
    assert why in table.choices["rms_norm"].reason  # fd doctor's row
    # the first child died in its first case; a second one probed the rest
    assert len(runs) == 2 and runs[0][0] == ("rms_norm", "float32") and ("rms_norm", "float32") not in runs[1]
    assert table.choices["silu_and_mul"].impl.name == "swiglu" and fused.available("silu_and_mul", "cpu")
    assert not fresh_probe.exists()  # an overridden case never reaches the cross-process cache


@pytest.mark.parametrize("flags,note", [
    (frozenset({"avx2", "fma"}), ("; this CPU has no AVX-512 (no avx512f among its flags in /proc/cpuinfo)")),
    (frozenset({"avx2", "avx512f", "avx512bw"}), ""),
    (None, ""),  # not Linux: nothing said about flags
])
def test_the_reason_names_the_kernel_and_the_signal(monkeypatch, flags, note):
    monkeypatch.setattr(fused, "_cpu_flags", lambda: flags)
    assert fused._death("fused_rms_norm", -signal.SIGILL) == (
        f"fused_rms_norm killed its probe process with SIGILL (Illegal instruction){note}", True)
    assert fused._death("swiglu", -signal.SIGSEGV)[0].startswith("swiglu killed its probe process with SIGSEGV")
    assert fused._death("swiglu", -signal.SIGKILL)[1] is False  # from outside: not cached
    assert fused._death("swiglu", 3, "MemoryError") == (
        "swiglu's probe process exited with status 3 before answering: MemoryError", False)


def test_the_cpu_probe_runs_outside_this_process_and_is_cached_across_processes(monkeypatch, fresh_probe):
    # this process's kernel is broken; the child's is not: the answer comes from the child
    def broken(*args, **kwargs):
        raise AssertionError("the CPU kernel ran in the engine's process")

    monkeypatch.setattr(fused.IF, "fused_rms_norm", broken)
    runs = []
    run_child = fused._run_child
    monkeypatch.setattr(fused, "_run_child", lambda place, cases: runs.append(list(cases)) or run_child(place, cases))
    expected = fused.probe("rms_norm", "cpu")
    assert expected[0] or expected[1].startswith(DIES)
    # one child for every kernel and dtype (and a second one for the rest if the first died)
    per_process = 1 if expected[0] else 2
    assert len(runs) == per_process and {c[0] for c in runs[0]} == set(fused.KERNELS)
    assert {c[1] for c in runs[0]} == {"float32", "float16", "bfloat16"}
    assert fused.probe("silu_and_mul", "cpu", "bfloat16")[1] and len(runs) == per_process
    assert fresh_probe.exists()
    # another process (this one, forgetting): the file answers, no child
    monkeypatch.setattr(fused, "_PROBED", {})
    assert fused.probe("rms_norm", "cpu") == expected and len(runs) == per_process
    # another CPU: another key, children again
    monkeypatch.setattr(fused, "_PROBED", {})
    monkeypatch.setattr(fused, "_cpu_flags", lambda: frozenset({"sse2"}))
    assert fused.probe("rms_norm", "cpu")[0] == expected[0] and len(runs) == 2 * per_process
    # a corrupt file is ignored, then rewritten
    fresh_probe.write_text("{not json")
    monkeypatch.setattr(fused, "_PROBED", {})
    assert fused.probe("rms_norm", "cpu")[0] == expected[0] and len(runs) == 3 * per_process
    assert isinstance(json.loads(fresh_probe.read_text())["entries"], dict)


def test_an_unwritable_cache_breaks_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(fused, "_PROBED", {})
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # fd/ cannot be made under a file
    runs = []
    run_child = fused._run_child
    monkeypatch.setattr(fused, "_run_child", lambda place, cases: runs.append(list(cases)) or run_child(place, cases))
    for n in (1, 2):  # a second process probes again
        monkeypatch.setattr(fused, "_PROBED", {})
        ok, why = fused.probe("silu_and_mul", "cpu")
        assert ok, why
        if n == 1:
            per_process = len(runs)  # 2 where a kernel killed the first child
    assert len(runs) == 2 * per_process and (tmp_path / "file").read_text() == ""


def test_a_probe_process_that_cannot_probe_declines_every_kernel_and_is_not_cached(monkeypatch, fresh_probe):
    monkeypatch.setattr(fused, "_CHILD", "import sys; sys.exit('paddle is broken here')")
    report = fused.probe_report("cpu")
    assert {why for dtypes in report.values() for why in dtypes.values()} == {
        "the probe process ended (status 1) before probing: paddle is broken here"}
    assert not fresh_probe.exists()


def test_a_probe_process_that_does_not_answer_in_time_declines_and_is_not_cached(monkeypatch, fresh_probe):
    monkeypatch.setattr(fused, "CHILD_TIMEOUT_S", 0.01)
    ok, why = fused.probe("silu_and_mul", "cpu")
    assert not ok and why == "the probe process did not answer within 0.01 s"
    assert not fresh_probe.exists()


# --- the base platform ------------------------------------------------------------------------


class ChipPlatform(PaddleDevicePlatform):
    name = "chip"
    device_type = "chip"
    paddle_device = "chipdev"
    visible_devices_env = "CHIP_VISIBLE_DEVICES"
    collective_backend = "xccl"
    collective_library = "cccl"
    requirement = "paddle-custom-chip"

    def __init__(self, found: tuple[int, str] = (0, "paddle 3.3.1 is not built with chip support; "
                                                     "install paddle-custom-chip")) -> None:
        self.found = found
        self.probes = 0

    def probe(self):
        self.probes += 1
        if isinstance(self.found, Exception):
            raise self.found
        return self.found

    def chip_capabilities(self):
        return self.manifest(("float32", "bfloat16"), memory_query=False)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.delenv("CHIP_VISIBLE_DEVICES", raising=False)


def test_is_a_platform():
    assert isinstance(ChipPlatform(), Platform)
    assert ChipPlatform.runtime == "paddle"


def test_unavailable_with_the_probe_sentence():
    p = ChipPlatform()
    ok, why = p.is_available()
    assert not ok and why == "paddle 3.3.1 is not built with chip support; install paddle-custom-chip"
    assert p.device_count() == 0
    assert p.capabilities().device_count == 0  # the manifest is still shown (fd backends)


def test_available_when_the_probe_finds_devices():
    p = ChipPlatform((4, ""))
    assert p.is_available() == (True, "")
    caps = p.capabilities()
    assert caps.device_count == 4
    assert caps.dtypes == frozenset({"float32", "bfloat16"}) == caps.kv_cache_dtypes
    assert caps.collective_library == "cccl"
    assert caps.quantization == {"wint8", "wint4"} and not caps.graph_capture and not caps.memory_profiling
    assert caps.prefix_caching and caps.chunked_prefill and caps.kv_swap and not caps.memory_query
    assert p.describe_devices() == ["chipdev:0", "chipdev:1", "chipdev:2", "chipdev:3"]
    assert p.default_max_num_batched_tokens is None and p.default_long_prefill_token_threshold is None
    assert p.runner_hooks() is None


def test_zero_devices_without_a_reason_still_says_why():
    ok, why = ChipPlatform((0, "")).is_available()
    assert not ok and why == "Paddle sees no chip device"


def test_a_failing_probe_is_a_reason_not_a_crash():
    p = ChipPlatform(OSError("libchip.so: cannot open shared object file"))
    ok, why = p.is_available()
    assert not ok and "libchip.so" in why and why.startswith("the chip probe could not run")


def test_empty_visible_devices_means_none_without_probing(monkeypatch):
    monkeypatch.setenv("CHIP_VISIBLE_DEVICES", "")
    p = ChipPlatform((8, ""))
    ok, why = p.is_available()
    assert not ok and why == "CHIP_VISIBLE_DEVICES is set but empty, so no chip device is visible"
    assert p.probes == 0


def test_helper_sentences():
    p = ChipPlatform()
    assert p.not_built(paddle, "chip support") == (
        0, f"paddle {paddle.__version__} is not built with chip support; install paddle-custom-chip")
    count, why = p.no_device(paddle)
    assert count == 0 and "CHIP_VISIBLE_DEVICES" in why


@pytest.mark.parametrize("value", ["chip", "other,chip", "all", " all "])
def test_emulate_env_names_platforms(monkeypatch, value):
    monkeypatch.setenv(EMULATE_ENV, value)
    assert emulated("chip") and ChipPlatform().emulated


def test_emulate_env_other_platform(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "xpu")
    assert not ChipPlatform().emulated


@pytest.mark.parametrize("visible,count", [(None, 1), ("0,1,2", 3), ("3", 1), ("", 0), (" , ", 0)])
def test_emulation_fakes_the_probe_from_the_visible_devices(monkeypatch, visible, count):
    monkeypatch.setenv(EMULATE_ENV, "chip")
    if visible is not None:
        monkeypatch.setenv("CHIP_VISIBLE_DEVICES", visible)
    p = ChipPlatform(AssertionError("the real probe must not run in emulation"))
    ok, why = p.is_available()
    assert (ok, p.device_count()) == (count > 0, count)
    assert why == ("" if count else "CHIP_VISIBLE_DEVICES is set but empty, so no chip device is visible")
    assert p.probes == 0


def test_emulated_capabilities_are_the_chip_narrowed_to_the_cpu(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "chip")
    monkeypatch.setenv("CHIP_VISIBLE_DEVICES", "0,1")
    caps = ChipPlatform().capabilities()
    assert caps == Capabilities(
        dtypes=frozenset({"float32"}), kv_cache_dtypes=frozenset({"float32"}),
        quantization=frozenset({"wint8", "wint4"}), graph_capture=False, prefix_caching=True, chunked_prefill=True, kv_swap=True,
        collective_library="gloo", pinned_host_memory=False, device_count=2, memory_query=True,
        memory_profiling=False, speculative_methods=frozenset({"ngram", "draft_model", "mtp"}),
    )


def test_emulated_memory_place_and_names(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "chip")
    p = ChipPlatform()
    memory = p.memory(0)
    assert isinstance(memory, runtime.PaddleMemory) and memory.device == "cpu"
    free, total = memory.memory_info()
    assert 0 < free <= total
    assert p.kernel_place() == "cpu"
    assert p.describe_devices() == ["chip 0 (emulated on the CPU: FD_EMULATE)"]
    assert p.default_max_num_batched_tokens == 48 and p.default_long_prefill_token_threshold == 24


def test_memory_on_the_chip_sets_the_device(monkeypatch):
    made, current = [], []
    monkeypatch.setattr(runtime, "PaddleMemory", lambda device: made.append(device) or device)
    p = ChipPlatform((2, ""))
    monkeypatch.setattr(p, "_set_device", current.append)
    assert p.memory(1) == "chipdev:1"
    assert made == ["chipdev:1"] and current == ["chipdev:1"]


def _record_init(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "init_process_group",
                        lambda rank, world_size, rendezvous, backend="gloo": calls.append(
                            (rank, world_size, rendezvous, backend)))
    return calls


def test_communicator_joins_the_chips_collective_backend(monkeypatch):
    calls = _record_init(monkeypatch)
    monkeypatch.delenv("FLAGS_selected_chipdevs", raising=False)
    monkeypatch.delenv("PADDLE_XCCL_BACKEND", raising=False)
    p = ChipPlatform((2, ""))
    devices = []
    monkeypatch.setattr(p, "_set_device", devices.append)
    comm = p.communicator(rank=3, world_size=4, rendezvous="127.0.0.1:1,2,3,4")
    assert isinstance(comm, Communicator) and (comm.rank, comm.world_size) == (3, 4)
    assert calls == [(3, 4, "127.0.0.1:1,2,3,4", "xccl")]
    assert devices == ["chipdev:1"]  # rank 3 of 2 devices
    import os

    assert os.environ["FLAGS_selected_chipdevs"] == "1"
    assert os.environ["PADDLE_XCCL_BACKEND"] == "chipdev"


def test_communicator_single_rank_joins_nothing(monkeypatch):
    calls = _record_init(monkeypatch)
    comm = ChipPlatform((1, "")).communicator()
    assert calls == [] and (comm.rank, comm.world_size) == (0, 1)


def test_emulated_communicator_uses_gloo(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "chip")
    calls = _record_init(monkeypatch)
    ChipPlatform().communicator(rank=1, world_size=2, rendezvous="127.0.0.1:5,6")
    assert calls == [(1, 2, "127.0.0.1:5,6", "gloo")]


def test_kernel_place_on_the_chip_is_the_current_device(monkeypatch):
    p = ChipPlatform((2, ""))
    monkeypatch.setattr(paddle.device, "get_device", lambda: "chipdev:1")
    assert p.kernel_place() == "chipdev:1"
    monkeypatch.setattr(paddle.device, "get_device", lambda: "cpu")
    assert p.kernel_place() == "chipdev:0"


# --- on an emulated CPU without AVX-512 -------------------------------------------------------

_QEMU_CPU = "Haswell-v4"  # AVX2 and FMA; QEMU's TCG implements no AVX-512

# The kernel as the one-liner of issue 14 runs it, with the default action for SIGILL (Paddle's own
# handler, glog's stack dumper, hangs under QEMU instead of ending the process).
_PLAIN_KERNEL = """
import signal
import paddle, paddle.incubate.nn.functional as F
signal.signal(signal.SIGILL, signal.SIG_DFL)
F.fused_rms_norm(paddle.ones([3, 16]), paddle.ones([16]), None, 1e-6, 1)
print("ran")
"""

# In the emulated process: the op table of a chip emulated on the CPU, and a step of the op it
# picked for rms_norm, against the spec.
_ON_THE_EMULATED_CPU = """
import json
import numpy as np
import paddle
from fd_core.plugins import OpRegistry
from fd_core.plugins.ops import op_context
from fd_core.runtimes.paddle import REFERENCE_OPS, fused
from fd_core.testing import spec

registry = OpRegistry()
registry.register_reference("paddle", REFERENCE_OPS)
fused.register_fused(registry, "chip", lambda: "cpu")
registry.use_reference("chip", "paddle")
table = registry.select("chip", "paddle", op_context("float32", 64))
x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
w = np.ones(64, np.float32)
got = table.rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-6).numpy()
print("RESULT " + json.dumps({
    "report": fused.probe_report("cpu"),
    "chosen": {op: [c.impl.name, c.reason] for op, c in table.choices.items()},
    "error": float(np.abs(got - spec.rms_norm(x, w, 1e-6)).max()),
}))
"""


@pytest.fixture
def emulated_python(tmp_path):
    """A ``python`` that runs this interpreter under ``qemu-x86_64 -cpu Haswell-v4``, and whose
    ``sys.executable`` is itself, so that the probe's child runs emulated too."""
    import platform
    import shutil

    if shutil.which("qemu-x86_64") is None or platform.machine() != "x86_64" or sys.platform != "linux":
        pytest.skip("needs qemu-x86_64 (Debian: qemu-user) on x86_64 Linux")
    root = tmp_path / "qemu-python"
    (root / "bin").mkdir(parents=True)
    (root / "lib").symlink_to(os.path.join(sys.prefix, "lib"))
    if os.path.exists(os.path.join(sys.prefix, "pyvenv.cfg")):
        (root / "pyvenv.cfg").write_text(Path(sys.prefix, "pyvenv.cfg").read_text())
    python = root / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec qemu-x86_64 -cpu {_QEMU_CPU} -0 "$0" {sys.executable} "$@"\n')
    python.chmod(0o755)
    return str(python)


def _emulated(python, code, tmp_path, **env):
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env})


@pytest.mark.slow
def test_on_a_cpu_without_avx512_fused_rms_norm_is_declined_and_the_reference_runs(emulated_python, tmp_path):
    """Issue 14: on an AVX2-only CPU Paddle's CPU fused_rms_norm dies with SIGILL. Under QEMU's
    Haswell, the kernel run plainly dies so; the probe declines it with that reason (its child
    runs under QEMU as well) and the op table's rms_norm, the reference, computes the spec."""
    plain = _emulated(emulated_python, _PLAIN_KERNEL, tmp_path)
    if plain.returncode == 0 and "ran" in plain.stdout:
        pytest.skip(f"fused_rms_norm runs under this qemu-x86_64 -cpu {_QEMU_CPU}: nothing to decline")
    assert plain.returncode == -signal.SIGILL, plain.stderr[-2000:]
    done = _emulated(emulated_python, _ON_THE_EMULATED_CPU, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    why = result["report"]["fused_rms_norm"]["float32"]
    assert why.startswith("fused_rms_norm killed its probe process with SIGILL (Illegal instruction)")
    assert result["report"]["swiglu"]["float32"] == "ok"  # probed by the next child
    name, reason = result["chosen"]["rms_norm"]
    assert name == "reference" and why in reason
    assert result["chosen"]["silu_and_mul"][0] == "swiglu"
    assert result["error"] < 1e-4
    assert "fused kernel fused_rms_norm declined on cpu for float32: " + why in done.stderr
