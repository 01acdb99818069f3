"""Installs small backend distributions into a folder, the way pip would lay them out
(package + ``*.dist-info`` with ``entry_points.txt``), so that discovery sees them as installed
packages when the folder is on ``sys.path`` / ``PYTHONPATH``."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install(site: Path, dist: str, module: str, source: str, entry_name: str, version: str = "0.1.0") -> None:
    pkg = site / module
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[fd.backends]\n{entry_name} = {module}\n")
    (info / "RECORD").write_text("")


BROKEN = """
    raise ImportError("libvendor_runtime.so: cannot open shared object file")
"""

OLD_API = """
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "0.3"

    @hookimpl
    def fd_platforms():
        raise AssertionError("an incompatible backend must never be called")
"""

# A working out-of-tree backend: a second CPU-like device whose only own op is a
# faster (here: instrumented) silu_and_mul; everything else falls back to the reference.
EXTRA_OP = """
    from fd_core.interfaces import Capabilities
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "1.0"
    CALLS = []

    class ToyPlatform:
        name = "toy"
        device_type = "toy"
        runtime = "paddle"

        def is_available(self):
            return True, ""

        def device_count(self):
            return 1

        def capabilities(self):
            return Capabilities(chunked_prefill=True, memory_query=True)

        def memory(self, device_index=0):
            from fd_core.runtimes.paddle import PaddleMemory
            return PaddleMemory("cpu")

        def communicator(self, rank=0, world_size=1):
            from fd_core.runtimes.paddle import PaddleCommunicator
            return PaddleCommunicator(rank, world_size)

        def runner_hooks(self):
            return None

    def silu_and_mul(x):
        CALLS.append(tuple(x.shape))
        from fd_core.runtimes.paddle import REFERENCE_OPS
        return REFERENCE_OPS["silu_and_mul"](x)

    @hookimpl
    def fd_platforms():
        return [ToyPlatform()]

    @hookimpl
    def fd_register_ops(registry):
        registry.register("silu_and_mul", "toy", silu_and_mul, name="toy-silu", priority=10)
        registry.register("rms_norm", "toy", lambda x, weight, eps, residual=None: x, name="never", priority=5,
                          supports=lambda dtype=None, **_: dtype == "int3")
        # a kernel built for one head size, as many fused rotary kernels are
        registry.register("rotary", "toy", rotary, name="toy-rope-16", priority=10,
                          supports=lambda head_dim=None, **_: head_dim == 16)

    def rotary(*args, **kwargs):
        from fd_core.runtimes.paddle import REFERENCE_OPS
        return REFERENCE_OPS["rotary"](*args, **kwargs)
"""

# a backend with no platform of its own, only op registrations (the lines that follow)
_OPS_ONLY = """
    from fd_core.plugins import hookimpl

    FD_API_VERSION = "1.0"

    @hookimpl
    def fd_platforms():
        return []

    @hookimpl
    def fd_register_ops(registry):
"""

# A backend whose registration fails part way, after it registered an op for a device type
# another backend (cpu) also runs: none of what it registered may stay behind.
HALF_REGISTERED = _OPS_ONLY + """        registry.register("silu_and_mul", "cpu", lambda x: x, name="half-silu", priority=99)
        registry.use_reference("halfchip", "paddle", name="half-reference")
        raise RuntimeError("the vendor kernel library is missing")
"""

# rms_norm without its residual: refused at registration, naming the plugin, the op and the contract
WRONG_SIGNATURE = _OPS_ONLY + """        def rms_norm(x, weight, eps):
            return x

        registry.register("rms_norm", "cpu", rms_norm, name="wrong-rms-norm", priority=99)
"""
