"""fd's entry point for this package: the Hygon DCU platform and its op table."""

from __future__ import annotations

from fd_core.plugins import hookimpl

FD_API_VERSION = "1.3"


@hookimpl
def fd_platforms():
    from fd_backend_dcu.platform import DcuPlatform

    return [DcuPlatform()]


@hookimpl
def fd_register_ops(registry):
    from fd_backend_dcu.platform import DcuPlatform

    # Paddle's fused kernels where they run on the chip, its standard kernels for the rest
    DcuPlatform().register_ops(registry)
