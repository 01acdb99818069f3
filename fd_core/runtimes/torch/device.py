"""TorchDevicePlatform: the Platform of a chip that PyTorch addresses as a device.

A vendor backend on the torch runtime (a chip whose torch build or extension adds a device type,
as ``torch_npu`` adds ``npu``) subclasses this class, sets the class attributes and implements
``chip_capabilities``; detection (``torch.<torch_device>.device_count()``), memory
(``TorchMemory``), collectives (``torch.distributed``), availability, emulation and device
naming are shared. Detection, emulation and the manifest are every device platform's
(``fd_core.runtimes.device``): emulated (``FD_EMULATE=<name>``), a platform runs on the CPU
with torch's reference ops, in float32 and bfloat16.

This module imports torch only inside the methods that use it, and only where the chip's device
files exist (or it has none to look for).
"""

from __future__ import annotations

import importlib
from typing import Any

from fd_core.runtimes.device import EMULATED_PLACE, DevicePlatform

__all__ = ["TorchDevicePlatform"]


class TorchDevicePlatform(DevicePlatform):
    """A chip torch addresses as ``<torch_device>:<index>``. Subclasses set the class attributes
    (``DevicePlatform``'s, ``torch_device`` and ``extension``) and implement
    :meth:`chip_capabilities`; :meth:`probe` asks ``torch.<torch_device>``."""

    runtime = "torch"
    library = "PyTorch"
    torch_device: str = ""  # torch's device type for the chip: tensors live on "<torch_device>:<i>"
    extension: str = ""  # the module that adds the device to torch (e.g. "torch_npu"); "": torch itself

    def import_torch(self) -> Any:
        """torch, with the chip's extension imported."""
        import torch

        if self.extension:
            importlib.import_module(self.extension)
        return torch

    def device_module(self) -> Any:
        """``torch.<torch_device>`` (``device_count``, ``set_device``...), or None."""
        return getattr(self.import_torch(), self.torch_device, None)

    def probe(self) -> tuple[int, str]:
        try:
            torch = self.import_torch()
        except ImportError as exc:
            return 0, f"{exc.name or self.extension} is not installed; install {self.requirement}"
        module = getattr(torch, self.torch_device, None)
        if module is None or not callable(getattr(module, "device_count", None)):
            return self.not_built(torch, f"the {self.torch_device} device (torch.{self.torch_device})")
        count = int(module.device_count())
        return (count, "") if count else self.no_device(torch)

    def place(self, device_index: int = 0) -> str:
        return EMULATED_PLACE if self.emulated else f"{self.torch_device}:{device_index}"

    def _set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's current device, where torch has the notion."""
        set_device = getattr(self.device_module(), "set_device", None)
        if set_device is not None:
            set_device(device_index)

    def memory(self, device_index: int = 0):
        from fd_core.runtimes.torch import TorchMemory

        if not self.emulated:
            self._set_device(device_index)  # kernels and collectives of this process go to this device
        return TorchMemory(self.place(device_index))

    def communicator(self, rank: int = 0, world_size: int = 1, rendezvous: str | None = None):
        from fd_core.runtimes import torch as runtime

        if world_size > 1:
            if self.emulated:
                runtime.init_process_group(rank, world_size, rendezvous, backend="gloo")
            else:
                self._set_device(rank % max(1, self.device_count()))  # rank r drives device r
                runtime.init_process_group(rank, world_size, rendezvous, backend=self.collective_backend)
        return runtime.TorchCommunicator(rank=rank, world_size=world_size)
