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
    from fd_core.runtimes.paddle.fused import register_fused

    from fd_backend_dcu.platform import DcuPlatform

    # The fused kernels this Paddle build ships, each where it runs on the device (emulated:
    # the CPU place, where the chip-only ones are missing and decline to the reference).
    register_fused(registry, "dcu", DcuPlatform().kernel_place)
    # Every other op is Paddle's standard kernel on the chip: this backend's own, not a fallback.
    registry.use_reference("dcu", "paddle")
