"""The quantized linear kernel alone, at Llama-3-8B's linear shapes, beside cuBLAS in bfloat16.

    python backends/cuda/benchmarks/bench_quantized_linear.py [--rows 1 16 128 1024]

For each shape and row count: microseconds per call (CUDA events, median of 50 after warm-up)
for bf16 (``F.linear``), wint8, wint4 (groups of 128, zero points) and block_wise_fp8, and the
weight bytes per second each achieves against the GPU's HBM bandwidth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from fd_core.interfaces import QuantizedWeight  # noqa: E402
from fd_core.quantization.quantize import quantize  # noqa: E402

from fd_backend_cuda.kernels.quantized_linear import dequantize, linear, pack_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def timed(fn, iters: int = 20) -> float:
    """Microseconds per call on the GPU alone: ``iters`` calls captured in one CUDA graph (as a
    decode step runs), so the host's launch cost is not counted; the median of 5 replays.
    ``fn`` may be a list of calls (each once per iteration: different weights, as layers are)."""
    calls = fn if isinstance(fn, list) else [fn]
    for _ in range(3):
        for call in calls:
            call()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(iters):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (iters * len(calls)))
    return float(np.median(times))


def nbytes(w: QuantizedWeight | torch.Tensor) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(t.numel() * t.element_size() for t in (w.qweight, w.scales, w.zeros) if t is not None)


def sweep() -> None:
    import itertools

    from fd_backend_cuda.kernels.quantized_linear import _config

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name in ("qkv", "down"):
        n, k = SHAPES[name]
        host = (torch.randn(n, k) * k**-0.5).numpy()
        for method, group, zeros in (("wint4", 128, True),):
            q = quantize(host, method, group, zeros)
            w = pack_linear(QuantizedWeight(method, torch.from_numpy(q.qweight).cuda(),
                                            torch.from_numpy(q.scales).cuda(), group, q.shape,
                                            None if q.zeros is None else torch.from_numpy(q.zeros).cuda()))
            step = 512 if method == "wint8" else 256  # wint4, groups of 128: chunks of 256 columns
            for m in (1, 128):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if m == 1:
                    space = itertools.product([16], [32, 64, 128], [128], [1, 2, 4, 8], [4, 8], [3, 4])
                else:
                    space = itertools.product([32, 64, 128], [64, 128], [64, 128], [1], [4, 8], [3, 4])
                results = []
                for cfg in space:
                    if cfg[2] != 128:  # int4 steps by the layout's chunk whatever BLOCK_K says
                        continue
                    try:
                        results.append((timed(lambda cfg=cfg: linear(x, w, config=cfg), 20), cfg))
                    except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                        results.append((float("inf"), f"{cfg}: {type(exc).__name__}"))
                results.sort(key=lambda r: r[0])
                chosen = _config(m, n, k, step, sms, method == "wint4")
                now = timed(lambda: linear(x, w), 20)
                dense = timed(lambda: torch.nn.functional.linear(x, dequantize(w, torch.bfloat16)))
                print(f"{name} {method} m={m}: best {results[0][0]:.1f} us {results[0][1]}; "
                      f"next {[(round(t, 1), c) for t, c in results[1:3]]}; heuristic {chosen} {now:.1f} us; "
                      f"dequantize + cuBLAS {dense:.1f} us",
                      flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128, 1024])
    ap.add_argument("--sweep", action="store_true", help="try tile configs at 1 and 128 rows; print the best")
    args = ap.parse_args()
    if args.sweep:
        sweep()
        return
    print(f"{torch.cuda.get_device_name(0)}; us per call (weight GB/s)")
    print(f"{'shape':<22}{'rows':>5}{'bf16':>16}{'wint8':>16}{'wint4':>16}{'fp8':>16}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * k**-0.5
        host = w.cpu().numpy()
        dense = w.to(torch.bfloat16)
        packed = {}
        for method, group, zeros in (("wint8", -1, False), ("wint4", 128, True), ("block_wise_fp8", 128, False)):
            q = quantize(host, method, group, zeros)
            on = QuantizedWeight(method, torch.from_numpy(q.qweight).cuda(), torch.from_numpy(q.scales).cuda(),
                                 group, q.shape, None if q.zeros is None else torch.from_numpy(q.zeros).cuda())
            packed[method] = pack_linear(on)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cells = []
            t = timed(lambda: torch.nn.functional.linear(x, dense))
            cells.append(f"{t:8.1f} ({n * k * 2 / t / 1e3:5.0f})")
            for method in ("wint8", "wint4", "block_wise_fp8"):
                t = timed(lambda method=method: linear(x, packed[method]))
                cells.append(f"{t:8.1f} ({nbytes(packed[method]) / t / 1e3:5.0f})")
            print(f"{name + f' {n}x{k}':<22}{m:>5}" + "".join(f"{c:>16}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
