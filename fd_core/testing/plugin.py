"""The conformance kit's pytest plugin, registered through fd-core's ``pytest11`` entry point.

    pytest --pyargs fd_core.conformance --fd-device NAME [--fd-runtime R] [--fd-emulate]

It adds those options and the fixtures the kit's tests (``fd_core.conformance``) use; in any
other pytest run it does nothing. Importing it imports no tensor library: discovery and the
runtime happen when the kit's tests are collected.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

from fd_core.interfaces import Capabilities, Platform
from fd_core.plugins.registry import (
    EMULATE_ENV,
    BackendRecord,
    BackendRegistry,
    emulated,
)

# The kit's modules are imported from site-packages (or star-imported by a backend's own test
# module): have pytest rewrite their asserts as it does for collected test files.
pytest.register_assert_rewrite("fd_core.conformance")


@dataclass
class BackendUnderTest:
    """The backend ``--fd-device`` names, as discovery found it."""

    device: str
    runtime: str | None
    registry: BackendRegistry
    record: BackendRecord | None
    platform: Platform | None
    available: bool
    reason: str  # why it cannot be tested (not found, failed, unavailable); empty when available
    _memory: Any = field(default=None, repr=False)

    @property
    def capabilities(self) -> Capabilities:
        assert self.platform is not None
        return self.platform.capabilities()

    @property
    def dtype(self) -> str:
        """The dtype the kit runs an engine, a KV cache or collectives in: float32 where
        declared, else the first dtype that is both a compute and a KV-cache dtype."""
        caps = self.capabilities
        usable = caps.dtypes & caps.kv_cache_dtypes
        return "float32" if "float32" in usable else min(usable or caps.dtypes)

    def require(self) -> None:
        """Skip the calling test unless the device can run: what needs the device says why not."""
        if not self.available:
            pytest.skip(self.reason)

    def memory(self) -> Any:
        self.require()
        if self._memory is None:
            self._memory = self.platform.memory(0)  # type: ignore[union-attr]
        return self._memory

    def implementations(self, op: str, context: dict[str, Any]) -> dict[str, Callable[..., Any]]:
        """Every implementation of ``op`` an engine could use for ``context`` on this backend, by
        name: each one registered for its device type and runtime whose ``supports()`` accepts,
        and the one the engine selects (the runtime's reference where nothing else applies)."""
        assert self.platform is not None
        p = self.platform
        found: dict[str, Callable[..., Any]] = {}
        table = self.registry.op_table(p, context)
        if table.has(op):
            found[table.choices[op].impl.name] = table.choices[op].impl.fn
        for impl in self.registry.ops.implementations(op, p.device_type, p.runtime):
            if impl.accepts(context)[0]:
                found.setdefault(impl.name, impl.fn)
        if op == "linear" and context.get("quantization"):
            # a quantized linear is tested on what its own pack_linear made of the weight
            packs = {i.name: i.fn for i in self.registry.ops.implementations("pack_linear", p.device_type, p.runtime)
                     if i.accepts(context)[0]}
            found = {name: _packed(fn, packs[name]) if name in packs else fn for name, fn in found.items()}
        if op == "moe":
            # a moe is tested on what its own pack_experts (paired by name) made of the experts
            packs = {i.name: i.fn for i in self.registry.ops.implementations("pack_experts", p.device_type, p.runtime)}
            found = {name: _packed_experts(fn, packs[name]) if name in packs else fn for name, fn in found.items()}
        return found


def _packed(linear: Callable[..., Any], pack: Callable[..., Any]) -> Callable[..., Any]:
    def run(x: Any, weight: Any, bias: Any = None) -> Any:
        return linear(x, pack(weight), bias)

    return run


def _packed_experts(moe: Callable[..., Any], pack: Callable[..., Any]) -> Callable[..., Any]:
    def run(x: Any, router: Any, gate_up: Any, down: Any, *args: Any, **kwargs: Any) -> Any:
        return moe(x, router, *pack(gate_up, down), *args, **kwargs)

    return run


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fd", "fd conformance kit: pytest --pyargs fd_core.conformance --fd-device NAME")
    group.addoption("--fd-device", default=None, metavar="NAME", help="the backend's device name (see fd backends)")
    group.addoption("--fd-runtime", default=None, metavar="RUNTIME",
                    help="the runtime to test it on (default: the backend's)")
    group.addoption("--fd-emulate", action="store_true",
                    help=f"test the device in its emulation mode (adds NAME to {EMULATE_ENV} before discovery)")


def pytest_configure(config: pytest.Config) -> None:
    device = config.getoption("fd_device", None)
    if not device and any(str(a).replace("/", ".").startswith("fd_core.conformance") for a in config.args):
        raise pytest.UsageError("the fd conformance kit needs --fd-device NAME (see `fd backends`)")
    if device and config.getoption("fd_emulate", False):
        names = [n for n in os.environ.get(EMULATE_ENV, "").split(",") if n.strip()]
        os.environ[EMULATE_ENV] = ",".join(names + [device])


_KEY = pytest.StashKey[BackendUnderTest]()


def backend_under_test(config: pytest.Config) -> BackendUnderTest:
    """Discovery runs once per session, when the kit's tests are first collected."""
    if _KEY in config.stash:
        return config.stash[_KEY]
    device = config.getoption("fd_device", None)
    if not device:
        raise pytest.UsageError("the fd conformance kit needs --fd-device NAME (see `fd backends`)")
    from fd_core.errors import FdError
    from fd_core.plugins import get_registry
    from fd_core.plugins.registry import bind_runtime

    runtime = config.getoption("fd_runtime", None)
    registry = get_registry()  # the one the engine uses, so the kit's LLMs see the same backends
    record = next((r for r in registry.records if any(p.name == device for p in r.platforms)), None)
    record = record or next((r for r in registry.records if r.name == device), None)
    platform = next((p for p in registry.platforms() if p.name == device), None)
    available, reason = False, ""
    if platform is None:
        reason = (f"--fd-device {device}: the backend failed to load: {record.error}" if record is not None
                  else f"--fd-device {device}: no installed backend provides it")
    else:
        try:
            platform = bind_runtime(platform, runtime)
            available, why = platform.is_available()
            reason = "" if available else f"--fd-device {device} is unavailable: {why}"
        except FdError as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken is_available fails its own test, not collection
            reason = f"--fd-device {device}: is_available() raised {type(exc).__name__}: {exc}"
    backend = BackendUnderTest(device, runtime, registry, record, platform, available, reason)
    config.stash[_KEY] = backend
    return backend


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    device = config.getoption("fd_device", None)
    if not device:
        return None
    b = backend_under_test(config)
    where = f"{b.record.package} {b.record.version}" if b.record else "not installed"
    runtime = b.platform.runtime if b.platform is not None else b.runtime or "-"
    state = "available" if b.available else b.reason
    mode = f" (emulated: {EMULATE_ENV}={os.environ.get(EMULATE_ENV)})" if emulated(device) else ""
    return [f"fd conformance kit: device {device}{mode} from {where}, runtime {runtime}: {state}"]


@pytest.fixture(scope="session")
def fd_backend(request: pytest.FixtureRequest) -> BackendUnderTest:
    return backend_under_test(request.config)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "fd_op_case" not in metafunc.fixturenames:
        return
    from fd_core.testing.opcases import cases

    backend = backend_under_test(metafunc.config)
    params, ids = [], []
    try:
        found = cases(backend.capabilities) if backend.platform is not None else []
    except Exception:  # noqa: BLE001 - a broken manifest fails its own test (test_contract), not collection
        found = []
    for case in found:
        for name in backend.implementations(case.op, case.context()):
            params.append((case, name))
            ids.append(f"{case.id}-{name}")
    if not params:  # nothing to run: one test that says why
        params, ids = [(None, None)], ["no-cases"]
    metafunc.parametrize(("fd_op_case", "fd_op_impl"), params, ids=ids)
