"""block_wise_fp8 linear: weight-only (the fused kernel / dequantize + cuBLAS) against W8A8
(activations quantized per 1 x 128, torch._scaled_mm) and bf16 cuBLAS, at Llama-3-8B's shapes.

    python backends/cuda/benchmarks/bench_w8a8.py [--rows 1 16 32 64 128 256 1024 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quantized_linear import SHAPES, timed
from fd_core.interfaces import QuantizedWeight
from fd_core.quantization.quantize import quantize

from fd_backend_cuda.kernels import quantized_linear as ql


def fp8_weight(n: int, k: int, dev: torch.device) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random ``[n, k]`` weight as packed block_wise_fp8 and its bf16 dequantization."""
    w = torch.randn(n, k, device=dev) * k**-0.5
    qw = quantize(w.cpu().numpy(), "block_wise_fp8", 128, False)
    packed = ql.pack_linear(QuantizedWeight("block_wise_fp8", torch.from_numpy(qw.qweight).to(dev),
                                            torch.from_numpy(qw.scales).to(dev), qw.group_size, qw.shape, None))
    return packed, ql.dequantize(packed, torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 1024, 4096])
    ap.add_argument("--parts", action="store_true",
                    help="time W8A8's two kernels apart: the activations' rounding and cuBLAS's GEMM")
    args = ap.parse_args()
    if args.parts:
        parts(args.rows)
        return
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda)
    print("| shape | rows | bf16 us | weight-only fp8 us | W8A8 us | W8A8 vs bf16 | W8A8 rel. error vs weight-only |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        packed, dense = fp8_weight(n, k, dev)
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = timed(lambda x=x: torch.nn.functional.linear(x, dense))
            saved = ql.W8A8_MIN_ROWS
            ql.W8A8_MIN_ROWS = 1 << 30
            t_wo = timed(lambda x=x: ql.linear(x, packed))
            y_wo = ql.linear(x, packed).float()
            ql.W8A8_MIN_ROWS = saved
            t_w8 = timed(lambda x=x: ql.w8a8_linear(x, packed))
            y_w8 = ql.w8a8_linear(x, packed).float()
            err = ((y_w8 - y_wo).norm() / y_wo.norm()).item()
            print(f"| {name} {n}x{k} | {m} | {t_bf16:.1f} | {t_wo:.1f} | {t_w8:.1f} | {t_bf16 / t_w8:.2f}x | {err:.4f} |",
                  flush=True)


def parts(rows: list[int]) -> None:
    """W8A8's two kernels apart: the activations' rounding and cuBLAS's block-scaled GEMM."""
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda)
    print("| shape | rows | bf16 us (TFLOP/s) | rounding us | FP8 GEMM us (TFLOP/s) | W8A8 vs bf16 |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        packed, dense = fp8_weight(n, k, dev)
        wt = packed.qweight.view(torch.float8_e4m3fn).t()
        sb = packed.scales[:, : k // 128].t()
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = timed(lambda x=x, dense=dense: torch.nn.functional.linear(x, dense))
            t_round = timed(lambda x=x: ql.fp8_rows(x))
            q, sa = ql.fp8_rows(x)
            t_gemm = timed(lambda q=q, sa=sa, wt=wt, sb=sb: torch._scaled_mm(q, wt, scale_a=sa, scale_b=sb,
                                                                            out_dtype=torch.bfloat16))
            flops = 2 * m * n * k
            print(f"| {name} {n}x{k} | {m} | {t_bf16:.1f} ({flops / t_bf16 / 1e6:.0f}) | {t_round:.1f} | "
                  f"{t_gemm:.1f} ({flops / t_gemm / 1e6:.0f}) | {t_bf16 / (t_round + t_gemm):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
