"""wint4/wint8 ``linear`` in blocks of 32 on CPUs with AVX2 and no AVX-512 (``--runtime torch``).

Why: ATen's int4 kernel (``torch_quantized.py``) is vectorised only for AVX-512. On an AVX2-only
EPYC it left SmolLM2 at 0.39x / 0.88x llama.cpp's tokens/s at 1 / 16 streams, and the float32
LM head (the GGUF's Q8_0 token embedding, 113 MB as float32) took 16 ms a row. Here the head as
Q8_0 takes 2.3 ms a row, and a Q4_1 decoder linear 1.05-1.7x less than ATen's at one row and
1.4x less at 16-48 (docs/PERFORMANCE.md). Tried first and not kept: ONNX Runtime's
``MatMulNBits`` (its thread pool and torch's fight over the cores) and numba (not vectorised).

``blocks_avx2.cpp`` holds ~80 lines of AVX2 intrinsics. It is built once, with the system's C++
compiler against the installed torch (about 4 s), into ``~/.cache/fd/kernels``. It runs on
torch's own threads (``at::parallel_for``), so the ops between two calls find those threads
awake. Where there is no compiler or the build fails, one warning names the reason and ATen's
kernels run; ``FD_CPU_BLOCKS=0`` turns it off.

Activations stay float32 and each weight is dequantized exactly, in registers (``q * d + m``),
so the product differs from a float32 matmul of the dequantized weight by summation order only.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from fd_core.host import cpu_flags
from fd_core.interfaces import QuantizedWeight

if TYPE_CHECKING:  # imported where used: the platform's capabilities read wanted() without torch
    import torch

log = logging.getLogger("fd.cpu")

SOURCE = Path(__file__).with_name("blocks_avx2.cpp")
BLOCK = 32
LAYOUTS = {"wint4": "cpu_blocks_q4_1", "wint8": "cpu_blocks_q8_0"}
FUNCTIONS = {"cpu_blocks_q4_1": "fd_q4_1_linear", "cpu_blocks_q8_0": "fd_q8_0_linear"}


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def wanted() -> bool:
    """Whether this CPU should run the block kernels: AVX2 and FMA without AVX-512, a compiler
    to build them, and ``FD_CPU_BLOCKS`` not ``0``."""
    flags = cpu_flags() or frozenset()
    return (os.environ.get("FD_CPU_BLOCKS", "1") != "0" and {"avx2", "fma"} <= flags
            and "avx512f" not in flags and compiler() is not None)


def fits(weight: QuantizedWeight) -> bool:
    in_features = weight.shape[1]
    return (weight.method in LAYOUTS and weight.group_size > 0 and weight.group_size % BLOCK == 0
            and in_features % weight.group_size == 0)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fd" / "kernels"


def _build(target: Path, torch_dir: Path) -> None:
    import torch

    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17", "-shared", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
             f"-I{torch_dir / 'include'}"]
    # the libraries after the source: with --as-needed (Debian's default) a library named
    # before the object that uses it is dropped
    libraries = [f"-L{torch_dir / 'lib'}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir / 'lib'}"]
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler(), *flags, str(SOURCE), *libraries, "-o", str(out)], capture_output=True, text=True,
                              timeout=300, check=False)
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no output")
        ctypes.CDLL(str(out))  # loads, or raises OSError naming what it lacks, before it is cached
        os.replace(out, target)  # whole or not at all, for processes that load it meanwhile


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, built on first use; None (with one warning) where they cannot be."""
    import torch

    torch_dir = Path(torch.__file__).parent
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {compiler()}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"blocks_avx2-{key}.so"
    try:
        if compiler() is None:
            raise RuntimeError("no C++ compiler: set CXX or install g++")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.parent / f"{target.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build for the processes that start together
            if not target.exists():
                log.info("building the AVX2 block kernels (%s) into %s", SOURCE.name, target.parent)
                _build(target, torch_dir)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("the AVX2 block kernels did not build (%s): wint4/wint8 run on ATen's kernels", e)
        return None
    for name in FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return lib


def usable() -> bool:
    return wanted() and library() is not None


def pack(weight: QuantizedWeight) -> QuantizedWeight:
    """The block layout: Q4_1's (16 bytes a block, element j in the low nibble of byte j and
    element j + 16 in its high nibble, ``w = u * d + m`` with ``u`` unsigned) or Q8_0's (32
    signed bytes, ``w = q * d`` plus ``m`` where the weight has zeros), one ``d``/``m`` a block."""
    import torch

    out_features, in_features = weight.shape
    blocks = in_features // BLOCK
    repeat = weight.group_size // BLOCK
    scales = weight.scales.to(torch.float32).reshape(out_features, -1)
    zeros = None if weight.zeros is None else weight.zeros.to(torch.float32).reshape(out_features, -1)
    if weight.method == "wint4":  # canonical q in [-8, 7]: w = q s + z = (q + 8) s + (z - 8 s)
        u = (weight.qweight.to(torch.int16) + 8).to(torch.uint8).reshape(out_features, blocks, BLOCK)
        qweight = u[..., :16] | (u[..., 16:] << 4)
        zeros = -8 * scales if zeros is None else zeros - 8 * scales
    else:
        qweight = weight.qweight.to(torch.int8).reshape(out_features, blocks, BLOCK).view(torch.uint8)
    d = scales.repeat_interleave(repeat, dim=1).contiguous()
    m = None if zeros is None else zeros.repeat_interleave(repeat, dim=1).contiguous()
    return QuantizedWeight(weight.method, qweight.contiguous(), d, BLOCK, weight.shape, m, LAYOUTS[weight.method])


def linear(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    import torch

    out_features, in_features = weight.shape
    # a decode step's call costs ~15 us of Python beside the kernel's 40-100 at one row: the
    # common case (a float32 matrix) goes straight through
    flat = x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, in_features).to(torch.float32).contiguous()
    y = torch.empty(rows.shape[0], out_features)
    if rows.shape[0]:
        zeros = weight.zeros
        getattr(library(), FUNCTIONS[weight.layout])(
            rows.data_ptr(), rows.shape[0], in_features, weight.qweight.data_ptr(), weight.scales.data_ptr(),
            None if zeros is None else zeros.data_ptr(), out_features, y.data_ptr())
    return y if flat else y.reshape(*x.shape[:-1], out_features).to(x.dtype)
