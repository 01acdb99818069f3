"""Small helpers shared by the kernel wrappers."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
}


def interpreting() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return bool(triton.knobs.runtime.interpret)


def sm_count(device: torch.device, otherwise: int = 1) -> int:
    """The multiprocessors of a CUDA device (asked once per device); ``otherwise`` for a CPU
    tensor's (Triton's interpreter), where launch plans only need a plausible figure."""
    if device.type != "cuda":
        return otherwise
    return _sm_count(device_index(device))


def resident_programs(device: torch.device, compiled) -> int | None:
    """How many programs of a compiled Triton kernel one multiprocessor of ``device`` holds at
    once (threads, registers and shared memory; None where the launch returned no compiled
    kernel, as in the interpreter, or torch does not report the multiprocessor's shared memory).
    Launch planners use it to predict waves."""
    n_regs = getattr(compiled, "n_regs", None)
    if device.type != "cuda" or not n_regs:
        return None
    props = torch.cuda.get_device_properties(device_index(device))
    smem = getattr(props, "shared_memory_per_multiprocessor", None)
    if smem is None:
        return None
    threads = 32 * compiled.metadata.num_warps
    by_smem = smem // (compiled.metadata.shared + 1024)  # the driver reserves 1 KiB a block
    by_regs = props.regs_per_multiprocessor // (n_regs * threads)
    by_threads = props.max_threads_per_multi_processor // threads
    return max(1, min(by_smem, by_regs, by_threads))


def device_index(device: torch.device) -> int:
    """The index of a CUDA device; the current one where the device names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability ``(major, minor)``, asked once per device."""
    return _capability(device_index(device))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


PDL_VARIABLE = "FD_CUDA_PDL"


def pdl(device: torch.device) -> dict:
    """The launch arguments of a kernel that begins with ``pdl_start``: programmatic dependent
    launch on sm90 and later (``FD_CUDA_PDL``, 1 by default; 0 turns it off), so the GPU
    schedules a kernel's programs while the one before it finishes instead of after. Nothing
    on the CPU (Triton's interpreter) or on older GPUs."""
    if device.type != "cuda" or interpreting():
        return {"PDL": False}
    on = _pdl(device_index(device))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@functools.cache
def _pdl(index: int) -> bool:
    raw = os.environ.get(PDL_VARIABLE, "1").strip() or "1"
    if raw not in ("0", "1"):
        from fd_core.errors import ConfigError

        raise ConfigError(f"{PDL_VARIABLE} must be 0 or 1, got {raw!r}")
    return raw == "1" and _capability(index)[0] >= 9


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """Early in a kernel launched with ``pdl``: wait until the kernel before it has finished
    and its writes are visible, then let the next kernel's programs be scheduled. Nothing is
    written before it, and nothing read but what no kernel of a step writes (weights: the
    few-row linear's first tile; ``test_kernels.py`` holds each kernel to its list), so a
    kernel overlaps the one ahead only with its launch, start-up and such reads."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} not supported (float32, float16, bfloat16)")


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last]`` with a unit stride on the last axis (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int (loop bounds, ``range``) with
    ``int(array)`` on a 1-element 1-D array, which NumPy 2.4 refuses; use ``.item()`` instead.
    Interpreter only: compiled kernels never go through this path."""
    from triton.runtime import interpreter

    if getattr(interpreter, "_fd_index_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))

    interpreter._patch_lang_tensor = patched
    interpreter._fd_index_patched = True


if interpreting():
    _patch_interpreter_index()
