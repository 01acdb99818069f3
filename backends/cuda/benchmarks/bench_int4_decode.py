"""wint4 at decode batch sizes: fd's kernel beside cuBLAS bf16 and the maintained int4 kernels
that install on this machine (GemLite's Triton kernels, torch's tinygemm), Llama-3-8B's shapes.

    python backends/cuda/benchmarks/bench_int4_decode.py [--rows 1 4 16]

Each call reads a different copy of the weight (copies totalling > 4x the L2 cache), as the
layers of a model do, so the figures are HBM bandwidth, not L2's. Microseconds per call inside
a CUDA graph, and the weight bytes per second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from fd_core.interfaces import QuantizedWeight
from fd_core.quantization.quantize import quantize

from fd_backend_cuda.kernels.quantized_linear import linear, pack_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantized_linear import timed  # the CUDA-graph timer

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


def gemlite_layer(qw: QuantizedWeight, n: int, k: int):
    import gemlite
    from gemlite import DType, GemLiteLinear

    layer = GemLiteLinear(4, group_size=GROUP, in_features=k, out_features=n,
                          input_dtype=DType.BF16, output_dtype=DType.BF16)
    u = (qw.qweight.to(torch.int16) + 8).to(torch.uint8)  # canonical int4 values q -> q + 8 in [0, 15]
    s = qw.scales.float()
    z = qw.zeros.float() if qw.zeros is not None else torch.zeros_like(s)
    # fd: w = q s + z = (u - 8) s + z; HQQ: w = (u - zz) s, so zz = 8 - z / s
    zz = 8.0 - z / torch.where(s == 0, 1.0, s)
    layer.pack(u, s.to(torch.bfloat16), zz.to(torch.bfloat16), None)
    del gemlite
    return layer


def tinygemm_weight(qw: QuantizedWeight):
    u = (qw.qweight.to(torch.int16) + 8).to(torch.uint8)
    packed = (u[:, ::2] << 4 | u[:, 1::2]).contiguous()
    w = torch._convert_weight_to_int4pack(packed, 8)
    s = qw.scales.float()
    z = qw.zeros.float() if qw.zeros is not None else torch.zeros_like(s)
    # tinygemm: w = (u - 8) * scale + zero, scales_and_zeros [groups, n, 2]
    sz = torch.stack([s.t(), z.t()], dim=-1).contiguous().to(torch.bfloat16)
    return w, sz


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    torch.manual_seed(0)
    l2 = 50 * 2**20
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    try:
        import gemlite

        print(f"gemlite {getattr(gemlite, '__version__', '?')}")
        have_gemlite = True
    except Exception as e:  # noqa: BLE001
        print(f"gemlite unavailable: {e}")
        have_gemlite = False
    print("| shape | rows | bf16 µs (TB/s) | fd wint4 | gemlite w4 | tinygemm | fd err | gemlite err | tinygemm err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize(w.float().cpu().numpy(), "wint4", GROUP, zeros=True)
        qt = QuantizedWeight(q.method, torch.from_numpy(q.qweight).cuda(), torch.from_numpy(q.scales).cuda(),
                             GROUP, q.shape, torch.from_numpy(q.zeros).cuda())
        packed = pack_linear(qt)
        int4_bytes = n * k // 2 + 2 * n * (k // GROUP) * 4
        copies = max(2, int(4 * l2 // (n * k // 2)) + 1)
        dense = [w.clone() for _ in range(max(2, int(4 * l2 // (n * k * 2)) + 1))]
        fd_w = [pack_linear(qt) for _ in range(copies)]
        glm = tg = None
        if have_gemlite:
            try:
                glm = [gemlite_layer(qt, n, k) for _ in range(copies)]
            except Exception as e:  # noqa: BLE001
                print(f"gemlite pack failed: {type(e).__name__}: {e}")
        try:
            tg = [tinygemm_weight(qt) for _ in range(copies)]
        except Exception as e:  # noqa: BLE001
            print(f"tinygemm unavailable: {type(e).__name__}: {e}")
        from fd_backend_cuda.kernels.quantized_linear import dequantize
        ref_w = dequantize(packed, torch.float32)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ ref_w.t()

            def err(y, ref=ref):
                return f"{float((y.float() - ref).abs().max() / ref.abs().max()):.1e}"

            t_bf16 = timed([lambda d=d, x=x: torch.nn.functional.linear(x, d) for d in dense], 3)
            t_fd = timed([lambda p=p, x=x: linear(x, p) for p in fd_w], 3)
            cells = [f"{t_bf16:.1f} ({n * k * 2 / t_bf16 / 1e6:.2f})", f"{t_fd:.1f} ({int4_bytes / t_fd / 1e6:.2f})"]
            errs = [err(linear(x, packed))]
            others = (
                (glm, lambda g, x: g(x)),
                (tg, lambda a, x: torch._weight_int4pack_mm(x, a[0], GROUP, a[1])),
            )
            for weights, call in others:
                if not weights:
                    cells.append("—")
                    errs.append("")
                    continue
                try:
                    t = timed([lambda w=w, x=x, call=call: call(w, x) for w in weights], 3)
                    cells.append(f"{t:.1f} ({int4_bytes / t / 1e6:.2f})")
                    errs.append(err(call(weights[0], x)))
                except Exception as e:  # noqa: BLE001
                    cells.append(f"failed: {type(e).__name__}: {str(e)[:80]}")
                    errs.append("")
            print(f"| {name} {n}×{k} | {m} | " + " | ".join(cells) + " | " + " | ".join(errs) + " |", flush=True)
        del dense, fd_w, glm, tg
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
