"""PaddleDevicePlatform: the one Platform behind every chip that Paddle addresses as a device.

A vendor backend on the Paddle runtime (Kunlunxin XPU, Iluvatar, Hygon DCU, Enflame GCU...)
differs from the others only in data: its Paddle place prefix, its visible-devices variable, the
``paddle.distributed`` backend of its collectives, how Paddle tells whether it is built for the
chip and how many devices it sees, and what fd can do on it. A backend subclasses this class,
sets the class attributes and implements ``probe`` and ``chip_capabilities``; memory,
collectives, availability, emulation and device naming are shared.

Detection, emulation and the manifest are every device platform's (``fd_core.runtimes.device``,
``DevicePlatform``): emulated (``FD_EMULATE=<name>``), a platform runs on the CPU place, where
chip-only kernels are unavailable and their adapters (``fd_core.runtimes.paddle.fused``)
decline, so the reference runs instead. This module imports paddle only inside the methods that
use it, and only where the chip's device files exist.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from fd_core.interfaces import Capabilities
from fd_core.plugins.registry import EMULATE_ENV, emulated
from fd_core.runtimes.device import EMULATED_PLACE, DevicePlatform

__all__ = ["EMULATE_ENV", "PaddleCustomDevicePlatform", "PaddleDevicePlatform", "emulated"]


class PaddleDevicePlatform(DevicePlatform):
    """A chip Paddle addresses as ``<paddle_device>:<index>``. Subclasses set the class
    attributes (``DevicePlatform``'s and ``paddle_device``) and implement :meth:`probe` and
    :meth:`chip_capabilities`."""

    runtime = "paddle"
    library = "Paddle"
    paddle_device: str = ""  # the place prefix: "xpu", "gpu", "iluvatar_gpu", "gcu"...

    def manifest(self, dtypes: Iterable[str], *, memory_query: bool = False,
                 pinned_host_memory: bool = False) -> Capabilities:
        """The manifest every Paddle device shares, for the chip's ``dtypes``: Paddle's
        reference ops' (``fd_core.runtimes.reference_capabilities``), with the chip's collective
        library and wint8/wint4 weights; ``PaddleMemory`` does not profile device memory."""
        # wint8/wint4 through weight_only_linear where the build has it, else the reference
        # (dequantize, then matmul): served either way (fused.py)
        return replace(super().manifest(dtypes, memory_query=memory_query, pinned_host_memory=pinned_host_memory),
                       quantization=frozenset({"wint8", "wint4"}))

    def place(self, device_index: int = 0) -> str:
        return EMULATED_PLACE if self.emulated else f"{self.paddle_device}:{device_index}"

    def kernel_place(self) -> str:
        """Where the op adapters probe their kernels: the CPU when emulated, else the device
        this process works on (set by :meth:`memory`), else device 0."""
        if self.emulated:
            return EMULATED_PLACE
        import paddle

        current = paddle.device.get_device()
        return current if current.split(":")[0] == self.paddle_device else self.place(0)

    def _set_device(self, place: str) -> None:
        import paddle

        paddle.device.set_device(place)

    def memory(self, device_index: int = 0):
        from fd_core.runtimes.paddle import PaddleMemory

        place = self.place(device_index)
        if not self.emulated:
            self._set_device(place)  # kernels and new tensors of this process go to this device
        return PaddleMemory(place)

    def communicator(self, rank: int = 0, world_size: int = 1, rendezvous: str | None = None):
        from fd_core.runtimes import paddle as runtime

        if world_size > 1:
            if self.emulated:
                runtime.init_process_group(rank, world_size, rendezvous, backend="gloo")
            else:
                index = rank % max(1, self.device_count())  # rank r drives device r
                # what paddle.distributed's init_parallel_env reads for a non-CPU backend
                os.environ[f"FLAGS_selected_{self.paddle_device}s"] = str(index)
                if self.collective_backend == "xccl":
                    os.environ.setdefault("PADDLE_XCCL_BACKEND", self.paddle_device)
                self._set_device(self.place(index))
                runtime.init_process_group(rank, world_size, rendezvous, backend=self.collective_backend)
        return runtime.PaddleCommunicator(rank=rank, world_size=world_size)

    def register_ops(self, registry: Any) -> None:
        """The op table of a chip whose Paddle build ships the usual fused kernels: their
        adapters where they run on the device (emulated: the CPU place, where the chip-only ones
        are missing and decline to the reference), and Paddle's standard kernels for every other
        op, adopted as this backend's own rather than a fallback. For ``fd_register_ops``."""
        registry.use_reference(self.device_type, "paddle")
        if self.detect()[0] <= 0:
            return  # no chip here: its table is never selected, and the adapters would import paddle
        from fd_core.runtimes.paddle.fused import register_fused

        register_fused(registry, self.device_type, self.kernel_place)


class PaddleCustomDevicePlatform(PaddleDevicePlatform):
    """A chip Paddle reaches through a PaddleCustomDevice plugin (``iluvatar_gpu``, ``gcu``...):
    detected by the plugin's device type, collectives on the custom-device XCCL."""

    collective_backend = "xccl"
    collective_library = "xccl"

    def probe(self) -> tuple[int, str]:
        import paddle

        if not paddle.is_compiled_with_custom_device(self.paddle_device):
            return self.not_built(paddle, f"the {self.paddle_device} custom device")
        count = int(paddle.base.core.get_custom_device_count(self.paddle_device))
        return (count, "") if count else self.no_device(paddle)
