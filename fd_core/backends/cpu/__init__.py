"""The built-in CPU backend: PaddlePaddle on the host, or PyTorch (``--runtime torch``).

Registered through fd-core's own ``fd.backends`` entry point, exactly like an external backend,
so the discovery path every vendor relies on is exercised by the default install.
"""

from __future__ import annotations

import dataclasses

from fd_core.backends.cpu import blocks
from fd_core.host import usable_cpus
from fd_core.interfaces import Capabilities
from fd_core.plugins import hookimpl
from fd_core.plugins.registry import runtime_installed
from fd_core.runtimes import HOST_DTYPES, reference_capabilities

FD_API_VERSION = "1.22"  # a quantized LM head (1.22), the reference sample adds logit biases (1.11) and applies grammar bitmasks (1.10), moe's expert_offset (1.7), quantized KV caches (1.6), pack_linear (1.5)


class CpuPlatform:
    """The host's cores. Runs on Paddle (the default) or on PyTorch's CPU build
    (``with_runtime("torch")``): Memory, Communicator (gloo either way) and dtypes follow the
    runtime; the op implementations are that runtime's reference ops, but for a plain
    ``linear`` of a few rows and a large weight (``few_rows.py``) and, on torch, wint8/wint4
    weights (``torch_quantized.py``)."""

    name = "cpu"
    device_type = "cpu"
    runtime = "paddle"
    runtimes = ("paddle", "torch")
    # --dtype auto: float32, which both runtimes compute exactly as the oracle tests check and in
    # which this backend's figures are measured (torch also offers bfloat16, asked for by name)
    default_dtype = "float32"
    # A step's length is the gap between two tokens of every stream it carries, and on these
    # compute-bound cores it grows with the step's tokens (~6.6 ms each; a 16-stream decode step
    # takes ~260 ms). At 48 tokens a step (decode rows included), nothing one request does —
    # 256 sequences at once, the most the server takes — stretches 16 streams' ITL p99 past
    # 2.3x, against 4x at 256, and the ITL tail under 16 chat clients drops from 2.1 s to
    # 0.7 s; it costs 11% on a lone 4,500-token prompt and 17% of output throughput under those
    # clients (more passes over the weights). docs/PERFORMANCE.md, "Limits".
    default_max_num_batched_tokens = 48
    # While a prompt prefills, every other prefilling request is held to this many tokens a
    # step and leftover budget goes back to it, so a request that arrives behind a 4,500-token
    # prompt starts in the next step instead of after the whole prompt (~60 s), and the prompt
    # alone loses nothing; half the budget leaves room beside it for new requests and the
    # decodes of up to 24 streams (docs/PERFORMANCE.md, "Scheduling").
    default_long_prefill_token_threshold = 24

    def __init__(self, runtime: str | None = None) -> None:
        if runtime is not None:
            if runtime not in self.runtimes:
                raise ValueError(f"the cpu platform runs on {', '.join(self.runtimes)}, not {runtime!r}")
            self.runtime = runtime

    def with_runtime(self, name: str) -> "CpuPlatform":
        return type(self)(name)

    def is_available(self) -> tuple[bool, str]:
        if not runtime_installed(self.runtime):
            return False, "no tensor library to run on: install " + " or ".join(f"fd-core[{r}]" for r in self.runtimes)
        return True, ""

    def device_count(self) -> int:
        # a "device" is a process on this host: tensor parallelism runs one per rank (gloo)
        return usable_cpus()

    def capabilities(self) -> Capabilities:
        caps = reference_capabilities(HOST_DTYPES[self.runtime], collective_library="gloo",
                                      pinned_host_memory=False, device_count=self.device_count(),
                                      memory_query=True)
        # an int8 / fp8 KV cache through either runtime's reference attention
        # (fd_core.quantization.kv_cache's format)
        caps = dataclasses.replace(caps, kv_cache_dtypes=caps.kv_cache_dtypes | QUANTIZED_KV_CACHE)
        if self.runtime == "torch":  # wint8/wint4 through torch's packed kernels
            caps = dataclasses.replace(caps, quantization=TORCH_QUANTIZATION)
            if blocks.wanted():  # AVX2's block kernels: float32 activations, weights exact
                caps = dataclasses.replace(caps, quantized_lm_head=frozenset({"wint8"}))
        return caps

    def memory(self, device_index: int = 0):
        if self.runtime == "torch":
            from fd_core.runtimes.torch import TorchMemory

            return TorchMemory("cpu")
        from fd_core.runtimes.paddle import PaddleMemory

        return PaddleMemory("cpu")

    def communicator(self, rank: int = 0, world_size: int = 1, rendezvous: str | None = None):
        if self.runtime == "torch":
            from fd_core.runtimes.torch import TorchCommunicator
            from fd_core.runtimes.torch import init_process_group as init_torch

            if world_size > 1:
                init_torch(rank, world_size, rendezvous, backend="gloo")
            return TorchCommunicator(rank=rank, world_size=world_size)
        from fd_core.runtimes.paddle import PaddleCommunicator, init_process_group

        if world_size > 1:
            init_process_group(rank, world_size, rendezvous, backend="gloo")
        return PaddleCommunicator(rank=rank, world_size=world_size)

    def runner_hooks(self):
        return None

    def describe_devices(self) -> list[str]:
        return [f"cpu ({usable_cpus()} cores)"]


@hookimpl
def fd_platforms():
    return [CpuPlatform(default_runtime())]


def default_runtime() -> str:
    """Paddle where it is installed, else torch where that is (fd-core installs neither unless
    asked: ``fd-core[paddle]`` or ``fd-core[torch]``), else Paddle, whose absence the
    platform then reports."""
    for runtime in CpuPlatform.runtimes:
        if runtime_installed(runtime):
            return runtime
    return CpuPlatform.runtime


@hookimpl
def fd_register_ops(registry):
    # A runtime's reference ops are this backend's implementation, not a fallback: adopt them
    # under the cpu device type so no fallback warning fires. Neither library is imported
    # here: each is imported only when an engine runs the cpu platform on it, so a machine
    # without Paddle (a GPU host with torch, say) still has `--device cpu --runtime torch`.
    registry.use_reference("cpu", "paddle")
    registry.use_reference("cpu", "torch")
    # wint8/wint4 weights on torch: PyTorch's packed CPU kernels (torch_quantized.py); Paddle has
    # no CPU kernel that reads integer weights, so there the weights are dequantized at load
    for op in ("linear", "pack_linear"):
        registry.register(op, "cpu", _lazy("torch_quantized", op), name="torch-packed", priority=10,
                          supports=_quantized_methods, runtime="torch")
    # plain weights: the product of a few rows and a large weight taken weight-major (few_rows.py),
    # on either runtime; anything else goes on to the runtime's reference linear
    for runtime in CpuPlatform.runtimes:
        registry.register("linear", "cpu", _lazy("few_rows", f"linear_{runtime}"), name="few-rows", priority=10,
                          supports=_plain, runtime=runtime)


TORCH_QUANTIZATION = frozenset({"wint8", "wint4"})
QUANTIZED_KV_CACHE = frozenset({"int8", "fp8_e4m3"})


def _quantized_methods(quantization: str | None = None, **_: object) -> bool:
    return quantization in TORCH_QUANTIZATION


_quantized_methods.why = lambda **_: "it serves wint8 and wint4 weights only"  # type: ignore[attr-defined]


def _plain(quantization: str | None = None, **_: object) -> bool:
    return quantization is None


_plain.why = lambda **_: "it serves plain weights only"  # type: ignore[attr-defined]


def _lazy(module: str, name: str):
    """``<module>.<name>`` of this package, imported at its first call (registration imports
    neither runtime)."""
    fn = None

    def call(*args, **kwargs):
        nonlocal fn
        if fn is None:
            import importlib

            fn = getattr(importlib.import_module(f"fd_core.backends.cpu.{module}"), name)
        return fn(*args, **kwargs)

    return call
