"""Plugin discovery and op registration. See ``hookspecs`` for what a backend implements."""

from fd_core.plugins.hookspecs import hookimpl, hookspec
from fd_core.plugins.ops import OpImpl, OpRegistry, OpTable
from fd_core.plugins.registry import (
    ALLOWLIST_ENV,
    ENTRY_POINT_GROUP,
    BackendRecord,
    BackendRegistry,
    get_registry,
)

__all__ = [
    "ALLOWLIST_ENV",
    "ENTRY_POINT_GROUP",
    "BackendRecord",
    "BackendRegistry",
    "OpImpl",
    "OpRegistry",
    "OpTable",
    "get_registry",
    "hookimpl",
    "hookspec",
]
