"""The fused MoE op (``kernels/moe.py``) on ERNIE-4.5-21B-A3B's sparse layer (64 experts, hidden
2560, expert width 1536, top-6), against the bytes of the experts it must read.

    python backends/cuda/benchmarks/bench_moe.py [--rows 1 8 64 ...] [--sweep]

For each token count and expert format (bfloat16, wint8, wint4, block_wise_fp8): microseconds per
call inside a CUDA graph (router, alignment and both grouped GEMMs; one layer's experts are
0.4 to 1.5 GB, far past the L2 cache), the router and the alignment alone (two Triton programs
up to ``FUSED_ALIGN_PAIRS`` pairs, torch ops above), the experts the tokens chose and
their bytes, and those bytes per second as a fraction of the GPU's HBM bandwidth (the whole op,
and the GEMMs alone, i.e. without the router and the alignment). Beside it, the torch reference
``moe`` (one cuBLAS pair per expert, eager: it reads the choices on the host). ``--sweep`` tries
tile configurations at 64 rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from fd_core.interfaces import QuantizedWeight
from fd_core.quantization.host import upload_quantized
from fd_core.quantization.quantize import quantize
from fd_core.runtimes.torch import ops as reference
from fd_core.runtimes.torch.memory import TorchMemory

from fd_backend_cuda.kernels import moe as fused

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized_linear import nbytes, timed  # the CUDA-graph timer, a weight's bytes
from e2e import HBM_BYTES_PER_S

E, H, I, TOP_K = 64, 2560, 1536, 6
GROUPS = {"wint8": -1, "wint4": 128, "block_wise_fp8": 128}


def experts(method: str | None) -> tuple[list, list]:
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = [torch.randn(2 * I, H, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(E)]
    down = [torch.randn(H, I, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(E)]
    if method is None:
        return gate_up, down

    def q(w: torch.Tensor) -> QuantizedWeight:
        qw = quantize(w.float().cpu().numpy(), method, GROUPS[method], zeros=method == "wint4")
        return upload_quantized(qw, TorchMemory("cuda"))

    return [q(w) for w in gate_up], [q(w) for w in down]


def wall_us(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 1024, 4096])
    parser.add_argument("--methods", nargs="+", default=["bf16", "wint8", "wint4", "block_wise_fp8"])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-reference", action="store_true")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    print(f"{name}  torch {torch.__version__}  HBM peak {peak / 1e12 if peak else '?'} TB/s")
    router = torch.randn(E, H, device="cuda") * H**-0.5
    print("| experts | rows | experts hit | bytes read MB | moe µs | route+align µs | HBM % (op) | HBM % (GEMMs) "
          "| reference µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label in args.methods:
        method = None if label == "bf16" else label
        gate_up, down = experts(method)
        per_expert = nbytes(gate_up[0]) + nbytes(down[0])
        packed = fused.pack_experts(gate_up, down)
        for n in args.rows:
            x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
            ids, _ = reference.route(x, router, TOP_K)
            hit = int(torch.unique(ids).numel())
            read = hit * per_expert
            t_op = timed(lambda: fused.moe(x, router, *packed, TOP_K), iters=10)
            block_m = fused._block_m(x, *packed, n * TOP_K)
            if n * TOP_K <= fused.FUSED_ALIGN_PAIRS:  # as the op does: two Triton programs
                t_align = timed(lambda: fused.route_and_align(x.float() @ router.t(), TOP_K, "softmax", True, None,
                                                              0, E, block_m), iters=10)
            else:  # torch's route, then align
                t_align = timed(lambda: fused.align(reference.route(x, router, TOP_K)[0], E, block_m), iters=10)
            ref = "-"
            if not args.no_reference and n <= 1024:
                ref = f"{wall_us(lambda: reference.moe(x, router, gate_up, down, TOP_K)):.0f}"
            frac = f"{read / (t_op * 1e-6) / peak * 100:.0f}" if peak else "?"
            gemm = t_op - t_align
            frac_gemm = f"{read / (gemm * 1e-6) / peak * 100:.0f}" if peak else "?"
            print(f"| {label} | {n} | {hit} | {read / 1e6:.0f} | {t_op:.0f} | {t_align:.0f} | {frac} | {frac_gemm} "
                  f"| {ref} |", flush=True)
        if args.sweep:
            n = 64
            x = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
            ids, weights = reference.route(x, router, TOP_K)
            want = fused.fused_experts(x, ids, weights, *packed).float()
            for config in [(32, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (64, 256, 4, 2),
                           (32, 256, 4, 3), (128, 128, 8, 3), (64, 128, 4, 4), (32, 64, 4, 4)]:
                try:
                    t = timed(lambda c=config: fused.fused_experts(x, ids, weights, *packed, config=c), iters=10)
                    got = fused.fused_experts(x, ids, weights, *packed, config=config).float()
                    err = float((got - want).abs().max())
                    print(f"sweep {label} rows {n} config {config}: {t:.0f} µs (max diff {err:.1e})", flush=True)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
                    print(f"sweep {label} config {config}: {type(exc).__name__}: {str(exc)[:100]}")
        gate_up = down = packed = None  # the experts freed before the next method's (not del: ruff then flags the lambdas)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
