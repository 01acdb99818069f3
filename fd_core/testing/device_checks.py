"""The platform tests every backend on a device base (``fd_core.runtimes.device``) needs without
its chip, whatever its library: a backend's test module subclasses the library's checks
(``fd_core.testing.paddle_device``, ``fd_core.testing.torch_device``) as
``Test<Chip>Platform``, sets the chip's facts as class attributes, and pytest runs every check
against it.

What they cover: detection through a faked library (built for the chip with devices, without
devices, not built) once the driver's device files exist, no library asked where they do not,
the sentence on this machine, the manifest on the chip, and (in the library's checks) the op
table in emulation. The generic behaviour of the bases (visible-devices variable, emulation,
memory, collectives) is fd-core's own tests'.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fd_core.plugins import OpRegistry
from fd_core.plugins.registry import EMULATE_ENV
from fd_core.runtimes import device_nodes
from fd_core.runtimes.device_nodes import IGNORE_ENV as IGNORE_DEVICE_NODES


class DeviceChecks:
    platform_class: ClassVar[type]
    plugin: ClassVar[Any]  # the module with the fd hooks
    visible_devices_env: ClassVar[str]
    collectives: ClassVar[tuple[str, str]]  # (the library's distributed backend, Capabilities' library)
    not_built: ClassVar[str]  # the sentence after "<library> <version> " when the library lacks the chip
    dtypes: ClassVar[frozenset[str]]
    quantization: ClassVar[frozenset[str]] = frozenset()
    memory_query: ClassVar[bool] = False
    pinned_host_memory: ClassVar[bool] = False
    emulated_ops: ClassVar[dict[str, str]]  # op -> the implementation chosen in emulation

    def library(self) -> Any:
        """The library's module (paddle, torch)."""
        raise NotImplementedError

    def prefix(self) -> str:
        """Where the chip's tensors live: ``<prefix>:<index>``."""
        raise NotImplementedError

    def fake_library(self, monkeypatch: pytest.MonkeyPatch, built: bool, count: int) -> None:
        """Make the library answer as a build for the chip (``built``) with ``count`` devices,
        or as one without the chip."""
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
        assert p.visible_devices_env == self.visible_devices_env
        assert p.collective_backend == self.collectives[0]  # the library's: test_capabilities_on_the_chip

    def test_detected_through_the_library(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        self.fake_library(monkeypatch, built=True, count=8)
        p = self.platform_class()
        assert p.is_available() == (True, "")
        assert p.device_count() == p.capabilities().device_count == 8
        assert p.describe_devices()[0] == f"{self.prefix()}:0"

    def test_not_built_for_the_chip(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        lib = self.library()
        self.fake_library(monkeypatch, built=False, count=0)
        assert self.platform_class().is_available() == (False, f"{lib.__name__} {lib.__version__} {self.not_built}")

    def test_built_but_no_device(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        self.fake_library(monkeypatch, built=True, count=0)
        ok, why = self.platform_class().is_available()
        assert not ok and "sees no device" in why and self.visible_devices_env in why

    def test_this_machine(self) -> None:
        lib = self.library()
        p = self.platform_class()
        ok, why = p.is_available()
        if ok:
            pytest.skip("this machine has the chip")
        assert "\n" not in why
        if device_nodes.missing(p.device_nodes, p.name):  # no driver: the library is not asked
            assert why.startswith(f"no {p.name} device: none of {p.device_nodes[0]} exists")
        else:
            assert why.startswith(f"{lib.__name__} {lib.__version__} ") or " is not installed; install " in why

    def test_without_the_driver_the_library_is_not_asked(self, monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
        p = self.platform_class()
        monkeypatch.setattr(type(p), "device_nodes", (str(tmp_path / "chip[0-9]*"),))
        monkeypatch.setattr(type(p), "probe", lambda _: pytest.fail("the library was asked"))
        registry = OpRegistry()
        self.plugin.fd_register_ops(registry)
        why = (f"no {p.name} device: none of {tmp_path}/chip[0-9]* exists (the driver creates them; in a "
               f"container, pass the devices in); set {IGNORE_DEVICE_NODES}=1 to ask the library anyway")
        assert p.is_available() == (False, why)
        # no kernel of the chip registered, so none imported the library
        assert not any(registry.implementations(op, p.device_type) for op in self.emulated_ops)
        monkeypatch.setenv(IGNORE_DEVICE_NODES, "1")
        monkeypatch.setattr(type(p), "probe", lambda _: (0, "asked"))
        assert p.is_available() == (False, "asked")

    def test_capabilities_on_the_chip(self, monkeypatch: pytest.MonkeyPatch, driver: Path) -> None:
        self.fake_library(monkeypatch, built=True, count=2)
        caps = self.platform_class().capabilities()
        assert caps.dtypes == caps.kv_cache_dtypes == self.dtypes
        assert caps.quantization == self.quantization
        assert not caps.graph_capture and not caps.memory_profiling
        assert caps.prefix_caching and caps.chunked_prefill and caps.kv_swap
        assert caps.speculative_methods == {"ngram", "draft_model", "mtp"}  # verified as chunked prefill runs
        assert (caps.memory_query, caps.pinned_host_memory) == (self.memory_query, self.pinned_host_memory)
        assert caps.collective_library == self.collectives[1] and caps.device_count == 2

    def emulated_registry(self, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, OpRegistry]:
        """The platform in emulation and an op registry holding this plugin's ops and its
        runtime's reference ops, as an engine would select from."""
        p = self.platform_class()
        monkeypatch.setenv(EMULATE_ENV, p.name)
        registry = OpRegistry()
        self.plugin.fd_register_ops(registry)
        registry.register_reference(p.runtime, importlib.import_module(f"fd_core.runtimes.{p.runtime}").REFERENCE_OPS)
        return p, registry
