"""8-bit weights (wint8 per channel, block_wise_fp8) at one row (batch-1 decode): the one-row
kernels (``kernels/gemv.py``'s ``gemv_8bit``) beside the tiled quantized kernel they replace
there and fd's bf16 kernel, Llama-3-8B's shapes.

    python backends/cuda/benchmarks/bench_8bit_gemv.py [--sweep]

Each call reads a different copy of the weight (copies totalling > 4x the L2 cache), so the
figures are HBM bandwidth. Microseconds per call inside a CUDA graph, weight bytes per second
in brackets. ``--sweep`` adds launch configurations of the few-row kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from fd_core.interfaces import QuantizedWeight

from fd_backend_cuda.kernels import gemv as g
from fd_backend_cuda.kernels._common import sm_count
from fd_backend_cuda.kernels.quantized_linear import _config, linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized_linear import timed  # the CUDA-graph timer

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
SWEEP = {g.FP8_BLOCKS: [g.Config(1, 4096, 4, True), g.Config(2, 1024, 4, True), g.Config(4, 1024, 4, True),
                        g.Config(2, 2048, 8, True), g.Config(2, 2048, 4, False), g.Config(2, 512, 4, True)],
         g.ROW_SCALES: [g.Config(4, 1024, 4, True), g.Config(1, 4096, 4, True), g.Config(2, 4096, 8, True),
                        g.Config(2, 2048, 4, False)]}


def weights(kind: int, n: int, k: int, copies: int) -> list[QuantizedWeight]:
    out = []
    for _ in range(copies):
        if kind == g.FP8_BLOCKS:
            bits = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, device="cuda")  # finite, positive
            scales = torch.rand((-(-n // 128), -(-k // 512) * 4), device="cuda") * 1e-3
            out.append(QuantizedWeight("block_wise_fp8", bits, scales, 128, (n, k), None, "cuda_fp8"))
        else:
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda")
            out.append(QuantizedWeight("wint8", q, torch.rand((n, 1), device="cuda") * 1e-3, k, (n, k), None,
                                       "cuda_w8"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    sms = sm_count(torch.device("cuda"))
    print(torch.cuda.get_device_name(), "| us per call (weight TB/s)")
    for name, (n, k) in SHAPES.items():
        dense_copies = max(2, -(-200_000_000 // (n * k * 2)))
        dense = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(dense_copies)]
        for kind, label in ((g.ROW_SCALES, "wint8"), (g.FP8_BLOCKS, "fp8")):
            qws = weights(kind, n, k, max(2, -(-200_000_000 // (n * k))))
            for m in (1,):
                x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
                t_bf16 = timed([lambda w=w: g.gemv(x, w) for w in dense])
                tiled = _config(m, n, k, 128 if kind == g.FP8_BLOCKS else 512, sms, False)
                t_tiled = timed([lambda w=w: linear(x, w, config=tiled) for w in qws])
                t_new = timed([lambda w=w: linear(x, w) for w in qws])
                gb = n * k / 1e6
                line = (f"{name:8s} {n}x{k} rows {m}: bf16 {t_bf16:6.1f} ({2 * gb / t_bf16:.2f}) | {label} tiled "
                        f"{t_tiled:6.1f} ({gb / t_tiled:.2f}) | {label} few-row {t_new:6.1f} ({gb / t_new:.2f})")
                if args.sweep:
                    for c in SWEEP[kind]:
                        t = timed([lambda w=w: g.gemv_8bit(x, w.qweight, w.scales, kind, config=c) for w in qws])
                        line += f" | {tuple(c)[:4]} {t:.1f}"
                    line += f" | default {tuple(g.choose_config_8bit(n, k, kind, sms))[:4]}"
                print(line, flush=True)
            del qws
        del dense
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
