"""The few-row plain linear kernel (``kernels/gemv.py``) beside cuBLAS (``F.linear``), bf16, at
ERNIE-4.5-0.3B's and Llama-3-8B's linear shapes and 1, 2 and 4 rows.

    python backends/cuda/benchmarks/bench_gemv.py [--sweep] [--rows 1 2 4] [--shapes ernie_o ...]

Each call reads a different copy of the weight (copies totalling > 4x the L2 cache), as the
layers of a model do, so the figures are HBM bandwidth, not L2's: microseconds per call inside
a CUDA graph of at least 20 calls, and the weight bytes per second. ``err`` is the largest
difference from ``F.linear``'s output. ``--sweep`` also times a grid of launch configurations
and prints the best per shape (the rule in ``choose_config`` is tuned from it).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_quantized_linear import timed  # noqa: E402 - the CUDA-graph timer
from fd_backend_cuda.kernels.gemv import Config, choose_config, gemv  # noqa: E402

SHAPES = {  # name: (N, K) of the weight
    "ernie_qkv": (2560, 1024), "ernie_o": (1024, 2048), "ernie_gate_up": (6144, 1024),
    "ernie_down": (1024, 3072), "ernie_lm_head": (103424, 1024),
    "llama_qkv": (6144, 4096), "llama_o": (4096, 4096), "llama_gate_up": (28672, 4096),
    "llama_down": (4096, 14336),
}


def per_call(calls: list) -> float:
    """Microseconds per call (each on its own copy of the weight), at least 20 calls a graph."""
    return timed(calls, iters=-(-20 // len(calls)))


def grid(n: int, k: int) -> list[Config]:
    """The sweep's configurations for an ``[n, k]`` weight, at least one program per SM. CUDA-core
    kernel: 8 to 32 weight elements per thread a step, prefetch only where there is a next step.
    Tensor-core kernel: up to 128 KiB of pipeline buffers."""
    out = []
    for bn, bk, warps, prefetch in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (2, 4, 8),
                                                     (False, True)):
        if bk <= max(k, 256) and -(-n // bn) >= 132 and 8 <= bn * bk // (32 * warps) <= 32 and (k > bk or not prefetch):
            out.append(Config(bn, bk, warps, prefetch))
    for bn, bk, stages in itertools.product((16, 32, 64), (64, 128, 256, 512), (2, 3, 4, 6)):
        if bk <= k and -(-n // bn) >= 132 and stages * (bn + 16) * bk * 2 <= 128 * 1024 and stages <= k // bk + 1:
            out.append(Config(bn, bk, 4, dot=True, num_stages=stages))
    return out


def _compile(items: list) -> None:
    for m, n, k, config in items:
        gemv(torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16), config=config)
    torch.cuda.synchronize()


def precompile(items: list, jobs: int) -> None:
    """Compile the kernel for every ``(m, n, k, config)`` in ``jobs`` processes at once, into
    Triton's on-disk cache, which this process then reads (one by one the sweep's few hundred
    compilations take minutes)."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile, [items[i::jobs] for i in range(jobs)])


def short(c: Config) -> str:
    """``2x1024 w4 pf`` (CUDA cores, prefetch) or ``dot 64x128 w4 s4`` (tensor cores, 4 stages)."""
    if c.dot:
        return f"dot {c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages}"
    return f"{c.block_n}x{c.block_k} w{c.num_warps}" + (" pf" if c.prefetch else "")


def cell(t: float, nbytes: int) -> str:
    return f"{t:.1f} ({nbytes / t / 1e6:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="also time a grid of configurations")
    parser.add_argument("--jobs", type=int, default=16, help="processes compiling the sweep's kernels")
    parser.add_argument("--csv", help="write every sweep timing here (shape,m,config,us)")
    args = parser.parse_args()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MiB, torch {torch.__version__}")
    if args.sweep:
        start = time.perf_counter()
        items = {(m, 1024, SHAPES[name][1], c) for name in args.shapes for m in args.rows
                 for c in grid(*SHAPES[name]) + [choose_config(m, *SHAPES[name], props.multi_processor_count)]}
        precompile(sorted(items), args.jobs)
        print(f"compiled {len(items)} kernels in {time.perf_counter() - start:.0f} s", flush=True)
    csv = open(args.csv, "w") if args.csv else None
    rows_out = []
    for name in args.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        weights = [w] + [w.clone() for _ in range(max(1, int(4 * l2 // nbytes)))]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            config = choose_config(m, n, k, props.multi_processor_count)
            err = float((gemv(x, w, config=config).float() - ref.float()).abs().max())
            t_cublas = per_call([lambda w=w, x=x: F.linear(x, w) for w in weights])
            t_fd = per_call([lambda w=w, x=x, c=config: gemv(x, w, config=c) for w in weights])
            line = f"| {name} {n}×{k} | {m} | {cell(t_cublas, nbytes)} | {cell(t_fd, nbytes)} | {err:.1e} | {short(config)}"
            if args.sweep:
                tried = []
                start = time.perf_counter()
                for c in grid(n, k):
                    if float((gemv(x, w, config=c).float() - ref.float()).abs().max()) > 4 * max(err, 1e-2):
                        print(f"  {name} m={m} {short(c)}: wrong result", flush=True)
                        continue
                    tried.append((per_call([lambda w=w, x=x, c=c: gemv(x, w, config=c) for w in weights]), c))
                    if csv:
                        csv.write(f"{name},{m},{tried[-1][0]:.3f},{' '.join(map(str, c))}\n")
                tried.sort()
                for t, c in tried[:5]:
                    print(f"  {name} m={m} {t:6.2f} us {nbytes / t / 1e6:.2f} TB/s {short(c)}", flush=True)
                print(f"  ({len(tried)} configs, {time.perf_counter() - start:.0f} s)", flush=True)
                if tried:
                    line += f" | {cell(tried[0][0], nbytes)} | {short(tried[0][1])}"
            rows_out.append(line + " |")
            print(rows_out[-1], flush=True)
        del weights, w
        torch.cuda.empty_cache()
    if csv:
        csv.close()
    print()
    print("µs per call (weight TB/s); err: max |kernel - F.linear|")
    head = "| shape | rows | cuBLAS | fd gemv | err | config |" + (" best swept | its config |" if args.sweep else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
