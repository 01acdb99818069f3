"""Backend discovery: entry points, the ``FD_BACKENDS`` allowlist, the API-version check, and a
report of every backend that failed to load and why."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Iterable

import pluggy

from fd_core.errors import BackendError, ConfigError
from fd_core.interfaces import API_VERSION, Platform, is_compatible
from fd_core.plugins import hookspecs
from fd_core.plugins.ops import OpRegistry

log = logging.getLogger("fd.plugins")

ENTRY_POINT_GROUP = "fd.backends"
ALLOWLIST_ENV = "FD_BACKENDS"
# Platforms to run in their emulation mode (comma-separated names, or "all"): a backend that
# has one then fakes its device probe and runs on the CPU, so that its registration, detection,
# capability checks and op table can be exercised on a machine without the chip.
EMULATE_ENV = "FD_EMULATE"


def emulated(name: str) -> bool:
    """Whether the user asked for ``name``'s emulation mode (``FD_EMULATE``)."""
    names = {n.strip() for n in os.environ.get(EMULATE_ENV, "").split(",") if n.strip()}
    return name in names or "all" in names

# The backends fd's project publishes, for the hint when one is asked for and not installed (text
# only: the core never imports a backend by name).
PACKAGES = {name: f"fd-backend-{name}" for name in ("cuda", "xpu", "dcu", "gcu", "iluvatar")}

# Runtimes ship inside fd-core; a backend names one by key, or by module path for its own.
RUNTIMES = {"paddle": "fd_core.runtimes.paddle", "torch": "fd_core.runtimes.torch"}
# The tensor library behind each built-in runtime, and how to install it.
_LIBRARIES = {"paddle": ("paddle", "pip install 'fd-core[paddle]'"), "torch": ("torch", "pip install 'fd-core[torch]'")}


def availability(platform: Platform) -> tuple[bool, str]:
    """``platform.is_available()``, where a platform that raises is unavailable with the error as
    its reason: one broken backend must not stop device resolution or ``fd backends``."""
    try:
        ok, why = platform.is_available()
    except Exception as exc:  # noqa: BLE001
        return False, f"its availability check raised {type(exc).__name__}: {exc}"
    return bool(ok), str(why)


def platform_runtimes(platform: Platform) -> tuple[str, ...]:
    """The runtimes ``platform`` can run on, its current one first (API 1.2 ``runtimes``;
    a platform without it runs on its ``runtime`` only)."""
    listed = tuple(getattr(platform, "runtimes", None) or ())
    return (platform.runtime,) + tuple(r for r in listed if r != platform.runtime)


def runtime_installed(runtime: str) -> bool:
    """Whether the runtime's tensor library can be found, without importing it (fast: for
    ``fd backends``; ``bind_runtime`` imports it for real)."""
    library = _LIBRARIES.get(runtime, (runtime.split(".")[0], ""))[0]
    if library in sys.modules:  # imported already (a test's stand-in may have no spec to find), or blocked
        return sys.modules[library] is not None
    try:
        return importlib.util.find_spec(library) is not None
    except (ImportError, ValueError):
        return False


def import_runtime(runtime: str, flag: str = "") -> Any:
    """The runtime's module, or a BackendError (starting with ``flag``) saying why it cannot be
    imported."""
    try:
        module = importlib.import_module(RUNTIMES.get(runtime, runtime))
        if runtime in _LIBRARIES:  # a runtime package may import its library lazily: fail here, not later
            importlib.import_module(_LIBRARIES[runtime][0])
        return module
    except Exception as exc:  # noqa: BLE001 - ImportError, or a native library that fails to load
        hint = _LIBRARIES.get(runtime, (None, ""))[1]
        raise BackendError(
            f"{flag}the {runtime} runtime cannot be imported ({type(exc).__name__}: {exc})"
            + (f"; install it with {hint}" if hint else "")
        ) from None


def bind_runtime(platform: Platform, runtime: str | None) -> Platform:
    """``platform`` running on ``runtime`` (``--runtime``; None: the platform as it is, on its
    default runtime). A runtime the platform does not list is a ConfigError naming the flag,
    the backend and what it supports; one that is not installed is a BackendError."""
    if runtime is None:
        return platform
    supported = platform_runtimes(platform)
    if runtime not in supported:
        raise ConfigError(
            f"--runtime {runtime}: the {platform.name} backend runs on {', '.join(supported)}"
        )
    import_runtime(runtime, flag=f"--runtime {runtime}: ")
    if runtime == platform.runtime:
        return platform
    bound = platform.with_runtime(runtime)  # type: ignore[attr-defined]
    if bound.runtime != runtime:
        raise BackendError(f"--runtime {runtime}: the {platform.name} backend bound itself to {bound.runtime}")
    return bound


@dataclass
class BackendRecord:
    """One installed backend package as discovery saw it."""

    name: str  # entry-point name
    package: str  # distribution name
    version: str  # distribution version
    module: Any = None
    platforms: list[Platform] = field(default_factory=list)
    error: str = ""  # why it could not be used; empty when it loaded
    traceback: str = ""  # the failure's whole traceback (fd backends --verbose)

    @property
    def loaded(self) -> bool:
        return not self.error


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE)`` of the innermost frame outside fd-core that raised ``exc``: the
    plugin's own line, where an import or a hook failed."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(_CORE) and not f.filename.startswith("<")]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


_CORE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fd_core/


def _call(impl: pluggy.HookImpl, **kwargs: Any) -> Any:
    # pluggy lets an implementation take fewer arguments than the spec; honour that here too,
    # since hooks are called one plugin at a time to attribute results and failures.
    return impl.function(*[kwargs[name] for name in impl.argnames])


def _tcp_transfer(timeout: float):
    from fd_core.cluster.tcp_transfer import TcpTransfer

    return TcpTransfer(timeout)


def _nixl_transfer(timeout: float):  # ConfigError naming the package where NIXL is missing
    from fd_core.cluster.nixl_transfer import NixlTransfer

    return NixlTransfer(timeout)


# fd-core's own connectors, registered first: a package's connector cannot take their names
BUILTIN_TRANSFERS = {"tcp": (_tcp_transfer, "fd-core"), "nixl": (_nixl_transfer, "fd-core")}


class BackendRegistry:
    """Discovers backends once and answers which platforms and op implementations exist."""

    def __init__(self, entry_points: Iterable[metadata.EntryPoint] | None = None) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.ops = OpRegistry()
        self.records: list[BackendRecord] = []
        self.transfers: dict[str, tuple[Any, str]] = dict(BUILTIN_TRANSFERS)  # name -> (factory, package)
        self._load(list(entry_points) if entry_points is not None else self._entry_points())

    @staticmethod
    def _entry_points() -> list[metadata.EntryPoint]:
        found = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
        # one distribution can be visible twice (e.g. an editable install plus a path entry)
        unique: dict[tuple[str, str], metadata.EntryPoint] = {}
        for ep in found:
            unique.setdefault((ep.name, ep.value), ep)
        return sorted(unique.values(), key=lambda ep: ep.name)

    def _load(self, entry_points: list[metadata.EntryPoint]) -> None:
        allow = os.environ.get(ALLOWLIST_ENV, "").strip()
        allowed = {n.strip() for n in allow.split(",") if n.strip()} if allow else None
        for ep in entry_points:
            dist = getattr(ep, "dist", None)
            record = BackendRecord(
                name=ep.name,
                package=dist.metadata["Name"] if dist else "?",
                version=dist.version if dist else "?",
            )
            self.records.append(record)
            if allowed is not None and ep.name not in allowed:
                record.error = f"not loaded: not in {ALLOWLIST_ENV}={allow}"
                continue
            try:
                module = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a broken plugin must never stop the core
                if isinstance(exc, KeyboardInterrupt):
                    raise
                record.error = f"import failed: {type(exc).__name__}: {exc}{_where(exc)}"
                record.traceback = "".join(traceback.format_exception(exc))
                log.warning("backend %s (%s) failed to load: %s", ep.name, record.package, record.error)
                continue
            declared = getattr(module, "FD_API_VERSION", None)
            if declared is None:
                record.error = "does not declare FD_API_VERSION; cannot tell which fd plugin API it implements"
                continue
            ok, why = is_compatible(str(declared), API_VERSION)
            if not ok:
                record.error = f"incompatible: {why}"
                log.warning("backend %s (%s) skipped: %s", ep.name, record.package, record.error)
                continue
            record.module = module
            try:
                self.pm.register(module, name=ep.name)
            except Exception as exc:
                record.error = f"invalid hook implementation: {exc}"
                continue
            self._collect(record)

    def _collect(self, record: BackendRecord) -> None:
        impls = {i.plugin_name: i for i in self.pm.hook.fd_platforms.get_hookimpls()}
        try:
            if record.name in impls:
                platforms = _call(impls[record.name]) or []
                record.platforms = list(platforms) if isinstance(platforms, (list, tuple)) else [platforms]
            transfer_impls = {i.plugin_name: i for i in self.pm.hook.fd_kv_transfers.get_hookimpls()}
            if record.name in transfer_impls:
                for name, factory in (_call(transfer_impls[record.name]) or {}).items():
                    self.transfers.setdefault(name, (factory, record.package))
            op_impls = {i.plugin_name: i for i in self.pm.hook.fd_register_ops.get_hookimpls()}
            if record.name in op_impls:
                with self.ops.registering(record.package, str(getattr(record.module, "FD_API_VERSION", API_VERSION))):
                    _call(op_impls[record.name], registry=self.ops)
        except Exception as exc:
            record.error = f"hook failed: {type(exc).__name__}: {exc}{_where(exc)}"
            record.traceback = "".join(traceback.format_exception(exc))
            record.platforms = []
            log.warning("backend %s (%s) failed: %s", record.name, record.package, record.error)
            self.pm.unregister(name=record.name)

    # -- queries ---------------------------------------------------------------------------

    def platforms(self) -> list[Platform]:
        return [p for r in self.records if r.loaded for p in r.platforms]

    def failures(self) -> list[BackendRecord]:
        return [r for r in self.records if not r.loaded]

    def platform(self, device: str = "auto", runtime: str | None = None) -> Platform:
        """Resolve ``--device``: a platform name, or ``auto`` (the first available accelerator,
        else cpu; with ``runtime``, the first that runs on it). The error names what is
        installed, what is available and what failed. With ``runtime`` (``--runtime``) the
        platform is bound to it (``bind_runtime``)."""
        platforms = self.platforms()
        if device == "auto":
            usable = [p for p in platforms if availability(p)[0]]
            if runtime is not None:  # prefer a platform that runs on the asked runtime
                usable = [p for p in usable if runtime in platform_runtimes(p)] or usable
            accel = [p for p in usable if p.name != "cpu"]
            if accel or usable:
                return bind_runtime((accel or usable)[0], runtime)
            raise BackendError("no usable backend: " + self._summary(why_unavailable=True))
        for p in platforms:
            if p.name == device:
                ok, why = availability(p)
                if not ok:
                    raise BackendError(f"--device {device}: the backend is installed but unusable: {why}")
                return bind_runtime(p, runtime)
        failed = [r for r in self.failures() if r.name == device]
        if failed:
            raise BackendError(f"--device {device}: the backend failed to load: {failed[0].error}")
        hint = (f"install it with pip install {PACKAGES[device]}" if device in PACKAGES else
                "a backend is a package of its own (fd's are named fd-backend-<device>)")
        raise BackendError(f"--device {device}: no such backend; {hint}; {self._summary()}")

    def _summary(self, why_unavailable: bool = False) -> str:
        if why_unavailable:  # nothing is usable: say what each one lacks
            names = [f"{p.name} ({availability(p)[1]})" for p in self.platforms()] or ["none"]
        else:
            names = [p.name for p in self.platforms()] or ["none"]
        text = "installed backends: " + ", ".join(names)
        if self.failures():
            text += "; failed: " + "; ".join(f"{r.name} ({r.error})" for r in self.failures())
        return text

    def kv_transfer(self, name: str, timeout: float = 30.0):
        """A KV-cache connector (``--cache-transfer-protocol``): fd-core's ``tcp`` and ``nixl``,
        or one a package registered (``fd_kv_transfers``)."""
        if name not in self.transfers:
            raise ConfigError(f"--cache-transfer-protocol {name}: no such KV-cache connector is installed "
                              f"(installed: {', '.join(self.transfers)})")
        factory, _ = self.transfers[name]
        return factory(timeout)

    def reference_ops(self, runtime: str) -> dict[str, Callable[..., Any]]:
        return dict(import_runtime(runtime).REFERENCE_OPS)

    def op_table(self, platform: Platform, context: dict[str, Any] | None = None,
                 pins: dict[str, str] | None = None, methods: Iterable[str] = ()):
        """``methods``: the quantization methods whose ``linear`` is chosen too (see OpRegistry.select)."""
        self.ops.register_reference(platform.runtime, self.reference_ops(platform.runtime))
        return self.ops.select(platform.device_type, platform.runtime, context, pins, methods)


_registry: BackendRegistry | None = None


def get_registry(refresh: bool = False) -> BackendRegistry:
    """The process-wide registry; discovery runs once unless ``refresh``."""
    global _registry
    if _registry is None or refresh:
        _registry = BackendRegistry()
    return _registry
