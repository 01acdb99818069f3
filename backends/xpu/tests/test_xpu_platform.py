"""The xpu platform without the chip: detection through a faked Paddle, the visible-devices
variable, the capabilities it declares, the sentence when unavailable, and its emulation mode
(registration, fake probe, op table on the CPU place)."""

from __future__ import annotations

import paddle
import pytest
from fd_core.interfaces import Platform
from fd_core.plugins import OpRegistry
from fd_core.runtimes.paddle import REFERENCE_OPS
from fd_core.runtimes.paddle.device import EMULATE_ENV

from fd_backend_xpu import plugin
from fd_backend_xpu.platform import XpuPlatform

VISIBLE = "XPU_VISIBLE_DEVICES"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.delenv(VISIBLE, raising=False)


def fake_paddle(monkeypatch, built: bool, count: int) -> None:
    """What paddlepaddle-xpu answers (built) or the CPU build (not), with ``count`` XPUs."""
    monkeypatch.setattr(paddle, "is_compiled_with_xpu", lambda: built)
    monkeypatch.setattr(paddle.device.xpu, "device_count", lambda: count)


def test_names():
    p = XpuPlatform()
    assert isinstance(p, Platform)
    assert (p.name, p.device_type, p.runtime, p.paddle_device) == ("xpu", "xpu", "paddle", "xpu")
    assert (p.visible_devices_env, p.collective_backend, p.collective_library) == (VISIBLE, "bkcl", "bkcl")


def test_detected_through_paddle(monkeypatch):
    fake_paddle(monkeypatch, built=True, count=8)
    p = XpuPlatform()
    assert p.is_available() == (True, "")
    assert p.device_count() == p.capabilities().device_count == 8
    assert p.describe_devices()[0] == "xpu:0"


def test_not_built_for_the_chip(monkeypatch):
    fake_paddle(monkeypatch, built=False, count=0)
    ok, why = XpuPlatform().is_available()
    assert not ok and why == f"paddle {paddle.__version__} " + (
        "is not built with XPU support; install paddlepaddle-xpu")


def test_built_but_no_device(monkeypatch):
    fake_paddle(monkeypatch, built=True, count=0)
    ok, why = XpuPlatform().is_available()
    assert not ok and "sees no device" in why and VISIBLE in why


def test_this_machine_without_the_chip():
    if paddle.is_compiled_with_xpu():
        pytest.skip("this Paddle is built for the chip")
    ok, why = XpuPlatform().is_available()
    assert not ok and why.startswith(f"paddle {paddle.__version__} ")


def test_capabilities_on_the_chip(monkeypatch):
    fake_paddle(monkeypatch, built=True, count=2)
    caps = XpuPlatform().capabilities()
    assert caps.dtypes == caps.kv_cache_dtypes == frozenset({"float32", "float16", "bfloat16"})
    assert caps.quantization == frozenset()  # fd quantizes no weights at load yet
    assert not caps.graph_capture and not caps.memory_profiling and not caps.speculative_methods
    assert caps.prefix_caching and caps.chunked_prefill and caps.kv_swap
    assert caps.memory_query is False and caps.pinned_host_memory is False
    assert caps.collective_library == "bkcl"


def _registry() -> OpRegistry:
    registry = OpRegistry()
    plugin.fd_register_ops(registry)
    registry.register_reference("paddle", REFERENCE_OPS)
    return registry


def test_emulated_op_table(monkeypatch):
    """On the CPU place the fused RMSNorm and SwiGLU kernels run; the fused rope is a chip-only
    kernel, so the reference serves rotary; the rest are Paddle's standard kernels, adopted."""
    monkeypatch.setenv(EMULATE_ENV, "xpu")
    table = _registry().select("xpu", "paddle", {"dtype": "float32", "head_dim": 64, "quantization": None})
    chosen = {op: c.impl.name for op, c in table.choices.items()}
    assert chosen["rms_norm"] == "fused_rms_norm" and chosen["silu_and_mul"] == "swiglu"
    assert chosen["rotary"] == chosen["attention"] == chosen["linear"] == "reference"
    assert not table.missing()
    assert all("fallback" not in c.reason for c in table.choices.values())
