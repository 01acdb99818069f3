"""The platform tests every backend on ``PaddleDevicePlatform`` needs without its chip, written
once: a backend's test module subclasses :class:`PaddleDeviceChecks` (or
:class:`CustomDeviceChecks`) as ``Test<Chip>Platform``, sets the chip's facts as class
attributes, says how its Paddle build is faked, and pytest runs every check against it.

What they cover: the platform's names, detection through a faked Paddle (built for the chip
with devices, without devices, not built) once the driver's device files exist, no Paddle asked
where they do not, the sentence on this machine, the manifest on the chip, and the op table in
emulation. The generic behaviour of the base (visible-devices
variable, emulation, memory, collectives) is fd-core's own tests'.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest

from fd_core.plugins import OpRegistry
from fd_core.plugins.ops import op_context
from fd_core.plugins.registry import EMULATE_ENV
from fd_core.runtimes import device_nodes
from fd_core.runtimes.device_nodes import IGNORE_ENV as IGNORE_DEVICE_NODES

# The op table of a chip whose Paddle build ships the usual fused kernels
# (``PaddleDevicePlatform.register_ops``), emulated on the CPU place: CPU Paddle runs the fused
# RMSNorm and SwiGLU; the fused rope and the MoE dispatch/combine are chip-only, so rotary and
# moe run the reference. A fused kernel this CPU cannot run (Paddle 3.3.1's fused_rms_norm
# without AVX-512) is declined by its probe, and the check then expects the reference, with the
# probe's reason.
FUSED_ON_THE_CPU = {"rms_norm": "fused_rms_norm", "silu_and_mul": "swiglu", "rotary": "reference",
                    "attention": "reference", "linear": "reference", "moe": "reference"}


class PaddleDeviceChecks:
    platform_class: ClassVar[type]
    plugin: ClassVar[Any]  # the module with the fd hooks
    paddle_device: ClassVar[str]
    visible_devices_env: ClassVar[str]
    collectives: ClassVar[tuple[str, str]]  # (paddle.distributed backend, Capabilities' library)
    not_built: ClassVar[str]  # the sentence after "paddle <version> " when Paddle is not built for it
    dtypes: ClassVar[frozenset[str]]
    memory_query: ClassVar[bool] = False
    pinned_host_memory: ClassVar[bool] = False
    emulated_ops: ClassVar[dict[str, str]] = FUSED_ON_THE_CPU

    def fake_paddle(self, monkeypatch: pytest.MonkeyPatch, built: bool, count: int) -> None:
        """Make Paddle answer as a build for the chip (``built``) with ``count`` devices, or as
        one without the chip."""
        raise NotImplementedError

    @pytest.fixture(autouse=True)
    def _clean_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(EMULATE_ENV, raising=False)
        monkeypatch.delenv(self.visible_devices_env, raising=False)
        monkeypatch.delenv(IGNORE_DEVICE_NODES, raising=False)

    @pytest.fixture
    def driver(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
        """The chip's driver loaded: a device file where the platform looks for one."""
        node = tmp_path / "dev" / "chip0"
        node.parent.mkdir()
        node.touch()
        monkeypatch.setattr(self.platform_class, "device_nodes", (str(tmp_path / "dev" / "chip[0-9]*"),))
        return node

    def test_names(self) -> None:
        from fd_core.interfaces import Platform

        p = self.platform_class()
        assert isinstance(p, Platform)
        assert p.runtime == "paddle" and p.paddle_device == self.paddle_device
        assert p.visible_devices_env == self.visible_devices_env
        assert (p.collective_backend, p.collective_library) == self.collectives

    def test_detected_through_paddle(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        self.fake_paddle(monkeypatch, built=True, count=8)
        p = self.platform_class()
        assert p.is_available() == (True, "")
        assert p.device_count() == p.capabilities().device_count == 8
        assert p.describe_devices()[0] == f"{self.paddle_device}:0"

    def test_not_built_for_the_chip(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        import paddle

        self.fake_paddle(monkeypatch, built=False, count=0)
        assert self.platform_class().is_available() == (False, f"paddle {paddle.__version__} {self.not_built}")

    def test_built_but_no_device(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        self.fake_paddle(monkeypatch, built=True, count=0)
        ok, why = self.platform_class().is_available()
        assert not ok and "sees no device" in why and self.visible_devices_env in why

    def test_this_machine(self) -> None:
        import paddle

        p = self.platform_class()
        ok, why = p.is_available()
        if ok:
            pytest.skip("this machine has the chip")
        assert "\n" not in why
        if device_nodes.missing(p.device_nodes, p.name):  # no driver: paddle is not asked
            assert why.startswith(f"no {p.name} device: none of {p.device_nodes[0]} exists")
        else:
            assert why.startswith(f"paddle {paddle.__version__} ")

    def test_without_the_driver_paddle_is_not_asked(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        p = self.platform_class()
        monkeypatch.setattr(type(p), "device_nodes", (str(tmp_path / "chip[0-9]*"),))
        monkeypatch.setattr(type(p), "probe", lambda _: pytest.fail("paddle was asked"))
        registry = OpRegistry()
        self.plugin.fd_register_ops(registry)
        why = (f"no {p.name} device: none of {tmp_path}/chip[0-9]* exists (the driver creates them; in a "
               f"container, pass the devices in); set {IGNORE_DEVICE_NODES}=1 to ask the library anyway")
        assert p.is_available() == (False, why)
        assert not registry.implementations("rms_norm", p.device_type)  # no adapter, so no paddle import
        monkeypatch.setenv(IGNORE_DEVICE_NODES, "1")
        monkeypatch.setattr(type(p), "probe", lambda _: (0, "asked"))
        assert p.is_available() == (False, "asked")

    def test_capabilities_on_the_chip(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        self.fake_paddle(monkeypatch, built=True, count=2)
        caps = self.platform_class().capabilities()
        assert caps.dtypes == caps.kv_cache_dtypes == self.dtypes
        assert caps.quantization == {"wint8", "wint4"}  # weight_only_linear, else the reference
        assert not caps.graph_capture and not caps.memory_profiling and not caps.speculative_methods
        assert caps.prefix_caching and caps.chunked_prefill and caps.kv_swap
        assert (caps.memory_query, caps.pinned_host_memory) == (self.memory_query, self.pinned_host_memory)
        assert caps.collective_library == self.collectives[1] and caps.device_count == 2

    def test_emulated_op_table(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from fd_core.runtimes.paddle import REFERENCE_OPS, fused

        p = self.platform_class()
        monkeypatch.setenv(EMULATE_ENV, p.name)
        registry = OpRegistry()
        self.plugin.fd_register_ops(registry)
        registry.register_reference("paddle", REFERENCE_OPS)
        table = registry.select(p.device_type, "paddle", op_context("float32", 64))
        chosen = {op: c.impl.name for op, c in table.choices.items()}
        expected = dict(self.emulated_ops)
        for op, name in self.emulated_ops.items():
            if op in fused.KERNELS and name == fused._NAMES[op]:
                ok, why = fused.probe(op, p.kernel_place(), "float32")
                if not ok and "killed its probe process" in why:  # a kernel this CPU cannot run
                    expected[op] = "reference"
                    assert why in table.choices[op].reason
        assert {op: chosen[op] for op in self.emulated_ops} == expected
        assert not table.missing()
        assert all("fallback" not in c.reason for c in table.choices.values())
        # wint8/wint4 weights: weight_only_linear is a device kernel, so on the CPU place its probe
        # declines and the reference (dequantize, then matmul) serves them
        quantized = registry.select(p.device_type, "paddle", op_context("float32", 64),
                                    methods=frozenset({"wint8", "wint4"}))
        assert {m: c["linear"].impl.name for m, c in quantized.per_method.items()} == {"wint8": "reference",
                                                                                      "wint4": "reference"}
        assert not fused.probe("linear", p.kernel_place(), "float32")[0]


class CustomDeviceChecks(PaddleDeviceChecks):
    """For a ``PaddleCustomDevicePlatform``: Paddle faked as with and without its plugin."""

    collectives = ("xccl", "xccl")

    def fake_paddle(self, monkeypatch: pytest.MonkeyPatch, built: bool, count: int) -> None:
        import paddle

        kind = self.paddle_device
        monkeypatch.setattr(paddle, "is_compiled_with_custom_device", lambda k: built and k == kind)
        monkeypatch.setattr(paddle.base.core, "get_custom_device_count", lambda k: count if k == kind else 0)
