"""The hooks a backend package implements (pluggy project ``fd``).

A backend is a module named by an entry point in the group ``fd.backends``. It must define
``FD_API_VERSION`` (the contract version it was written against, e.g. ``"1.0"``) and may
implement any of the hooks below with ``@fd_core.plugins.hookimpl``. As with pluggy in
general, an implementation may accept fewer arguments than the spec names.
"""

from __future__ import annotations

import pluggy

from fd_core.interfaces import Platform

PROJECT = "fd"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def fd_platforms() -> list[Platform]:
    """Return the platforms this package provides (usually one)."""


@hookspec
def fd_register_ops(registry: "OpRegistry") -> None:  # type: ignore[name-defined]  # noqa: F821
    """Register op implementations with ``registry.register(...)``.

    Any package may do this, including one that adds a faster kernel for a chip whose platform
    lives in another package. An implementation that takes one runtime's tensors says which
    (``runtime="torch"``, API 1.2); ``registry.use_reference(device_type, runtime)`` adopts a
    runtime's reference ops as the package's own without importing that runtime here.
    """


@hookspec
def fd_kv_transfers() -> dict:
    """Return KV-cache connectors by name (API 1.14): ``{"name": factory}``, where
    ``factory(timeout)`` makes a ``fd_core.interfaces.kv_transfer.KVTransfer``. An instance
    started with ``--cache-transfer-protocol name`` moves requests' keys and values between
    prefill and decode instances with it. fd-core ships ``tcp``."""
