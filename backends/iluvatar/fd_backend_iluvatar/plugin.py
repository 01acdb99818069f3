"""fd's entry point for this package: the Iluvatar platform and its op table."""

from __future__ import annotations

from fd_core.plugins import hookimpl

FD_API_VERSION = "1.3"


@hookimpl
def fd_platforms():
    from fd_backend_iluvatar.platform import IluvatarPlatform

    return [IluvatarPlatform()]


@hookimpl
def fd_register_ops(registry):
    from fd_core.runtimes.paddle.fused import register_fused

    from fd_backend_iluvatar.platform import IluvatarPlatform

    # The fused kernels this Paddle build ships, each where it runs on the device (emulated:
    # the CPU place, where the chip-only ones are missing and decline to the reference).
    register_fused(registry, "iluvatar", IluvatarPlatform().kernel_place)
    # Every other op is Paddle's standard kernel on the chip: this backend's own, not a fallback.
    registry.use_reference("iluvatar", "paddle")
