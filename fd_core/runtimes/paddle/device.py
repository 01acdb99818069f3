"""PaddleDevicePlatform: the one Platform behind every chip that Paddle addresses as a device.

A vendor backend on the Paddle runtime (Kunlunxin XPU, Iluvatar, Hygon DCU, Enflame GCU...)
differs from the others only in data: its Paddle place prefix, its visible-devices variable, the
``paddle.distributed`` backend of its collectives, how Paddle tells whether it is built for the
chip and how many devices it sees, and what fd can do on it. A backend subclasses this class,
sets the class attributes and implements ``probe`` and ``chip_capabilities``; memory,
collectives, availability, emulation and device naming are shared.

Emulation (``FD_EMULATE=<name>[,<name>...]`` or ``all``): the named platforms replace their
device probe by a fake one and run on the CPU place, so that a backend's registration,
detection, capability checks and op table run on a machine without the chip. The fake probe
counts the entries of the chip's visible-devices variable (1 when it is unset; an empty
variable still means no device). Chip-only kernels are then unavailable on the CPU place and
their adapters (``fd_core.runtimes.paddle.fused``) decline, so the reference runs instead.

Detection first looks for the chip driver's device files (``device_nodes``,
``fd_core.runtimes.device_nodes``): where none exists the chip is absent and paddle is not
imported, so discovering a backend on a machine without its chip costs no paddle import. This
module imports paddle only inside the methods that use it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import replace
from typing import Any, Iterable

from fd_core.interfaces import Capabilities
from fd_core.plugins.registry import EMULATE_ENV, emulated
from fd_core.runtimes import HOST_DTYPES, device_nodes, reference_capabilities

__all__ = ["EMULATE_ENV", "PaddleCustomDevicePlatform", "PaddleDevicePlatform", "emulated"]

# What an emulated platform runs on.
EMULATED_PLACE = "cpu"


class PaddleDevicePlatform:
    """A chip Paddle addresses as ``<paddle_device>:<index>``. Subclasses set the class
    attributes below and implement :meth:`probe` and :meth:`chip_capabilities`."""

    name: str = ""  # what users type after --device
    device_type: str = ""  # keys op registration
    runtime = "paddle"
    paddle_device: str = ""  # the place prefix: "xpu", "gpu", "iluvatar_gpu", "gcu"...
    visible_devices_env: str = ""  # e.g. "XPU_VISIBLE_DEVICES"
    collective_backend: str = ""  # paddle.distributed's name: "bkcl", "xccl", "nccl"...
    collective_library: str = ""  # what Capabilities reports: "bkcl", "xccl", "rccl"...
    requirement: str = ""  # what to install for the chip, e.g. "paddlepaddle-xpu"
    device_nodes: tuple[str, ...] = ()  # globs of the driver's device files, e.g. ("/dev/xpu[0-9]*",)
    # A step of a few dozen tokens keeps an emulated (CPU) server's streams responsive, as on
    # the cpu backend; on the chip the engine's default applies.
    emulated_max_num_batched_tokens = 48
    emulated_long_prefill_token_threshold = 24  # likewise: the cpu backend's

    # -- what a backend implements ---------------------------------------------------------

    def probe(self) -> tuple[int, str]:
        """The devices Paddle sees on this machine; with 0, one sentence saying why, naming
        what is missing. Imports paddle; an exception counts as 0 devices with its message."""
        raise NotImplementedError

    def chip_capabilities(self) -> Capabilities:
        """What fd can do on the real chip (``device_count`` is filled in by the base). Must
        not import paddle: ``fd backends`` shows it for unavailable chips too."""
        raise NotImplementedError

    # -- helpers for subclasses ------------------------------------------------------------

    def manifest(self, dtypes: Iterable[str], *, memory_query: bool = False,
                 pinned_host_memory: bool = False) -> Capabilities:
        """The manifest every Paddle device shares, for the chip's ``dtypes``: Paddle's
        reference ops' (``fd_core.runtimes.reference_capabilities``), with the chip's collective
        library and wint8/wint4 weights; ``PaddleMemory`` does not profile device memory."""
        # wint8/wint4 through weight_only_linear where the build has it, else the reference
        # (dequantize, then matmul): served either way (fused.py)
        return replace(reference_capabilities(dtypes, collective_library=self.collective_library,
                                              pinned_host_memory=pinned_host_memory, memory_query=memory_query,
                                              memory_profiling=False),
                       quantization=frozenset({"wint8", "wint4"}))

    def not_built(self, paddle: Any, what: str) -> tuple[int, str]:
        return 0, f"paddle {paddle.__version__} is not built with {what}; install {self.requirement}"

    def no_device(self, paddle: Any) -> tuple[int, str]:
        return 0, (f"paddle {paddle.__version__} supports {self.name} but sees no device; check the "
                   f"driver and {self.visible_devices_env}")

    # -- emulation and detection -----------------------------------------------------------

    @property
    def emulated(self) -> bool:
        return emulated(self.name)

    @property
    def default_max_num_batched_tokens(self) -> int | None:
        return self.emulated_max_num_batched_tokens if self.emulated else None

    @property
    def default_long_prefill_token_threshold(self) -> int | None:
        return self.emulated_long_prefill_token_threshold if self.emulated else None

    def _empty_visible(self) -> str:
        return f"{self.visible_devices_env} is set but empty, so no {self.name} device is visible"

    def _fake_probe(self) -> tuple[int, str]:
        value = os.environ.get(self.visible_devices_env)
        if value is None:
            return 1, ""
        entries = [v for v in (s.strip() for s in value.split(",")) if v]
        return (len(entries), "") if entries else (0, self._empty_visible())

    def detect(self) -> tuple[int, str]:
        """``(devices, why not)``: the fake probe when emulated, else the visible-devices
        variable, the driver's device files and then :meth:`probe`."""
        if self.emulated:
            return self._fake_probe()
        value = os.environ.get(self.visible_devices_env)
        if value is not None and not value.strip():
            return 0, self._empty_visible()
        absent = device_nodes.missing(self.device_nodes, self.name)
        if absent:
            return 0, absent
        if not _paddle_installed():
            return 0, f"paddle is not installed; install {self.requirement}"
        try:
            count, why = self.probe()
        except Exception as exc:  # noqa: BLE001 - a broken paddle install must not stop fd backends
            return 0, f"the {self.name} probe could not run ({type(exc).__name__}: {exc})"
        if count <= 0:
            return 0, why or f"Paddle sees no {self.name} device"
        return count, ""

    # -- the Platform protocol -------------------------------------------------------------

    def is_available(self) -> tuple[bool, str]:
        count, why = self.detect()
        return count > 0, why

    def device_count(self) -> int:
        return self.detect()[0]

    def capabilities(self) -> Capabilities:
        chip = self.chip_capabilities()
        count = self.device_count()
        if not self.emulated:
            return replace(chip, device_count=count)
        # the chip's manifest, narrowed to what Paddle's CPU place runs
        cpu = HOST_DTYPES["paddle"]
        return replace(
            chip,
            dtypes=chip.dtypes & cpu,
            kv_cache_dtypes=chip.kv_cache_dtypes & cpu,
            collective_library="gloo",
            pinned_host_memory=False,
            graph_capture=False,
            memory_profiling=False,
            memory_query=True,  # PaddleMemory answers for the CPU (host RAM)
            device_count=count,
        )

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

    def runner_hooks(self):
        return None  # fd has no Paddle graph capture yet

    def describe_devices(self) -> list[str]:
        count = self.device_count()
        if self.emulated:
            return [f"{self.name} {i} (emulated on the CPU: {EMULATE_ENV})" for i in range(count)]
        return [self.place(i) for i in range(count)]

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


def _paddle_installed() -> bool:
    # a test's stand-in module may sit in sys.modules without a spec
    return "paddle" in sys.modules or importlib.util.find_spec("paddle") is not None
