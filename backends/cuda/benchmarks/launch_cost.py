"""What ``graph.replay()`` costs the host, unprofiled: synthetic graphs of many small kernels
beside fd's decode and mixed graphs (ERNIE-4.5-0.3B shape). ``torch.profiler`` records every
node of a graph under CUPTI, which makes ``cudaGraphLaunch`` look like ~2 us a node; this
times the call itself.

    python backends/cuda/benchmarks/launch_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from fd_core import LLM  # noqa: E402


def host_us(fn, reps: int = 60) -> float:
    """Median host time of ``fn`` over ``reps`` calls, synchronising every 8 so the queue stays short."""
    times = []
    for i in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def main() -> None:
    x = torch.zeros(256, device="cuda")
    for n in (50, 1600):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        print(f"synthetic graph of {n} kernels: replay {host_us(graph.replay):.1f} us", flush=True)
    model = e2e.build_model(Path("/tmp/fd-ernie-0.3b"))
    llm = LLM(model=str(model), device="cuda", dtype="bfloat16", max_model_len=1300, max_num_seqs=128)
    forward = llm.engine.core.executor.runner.forward
    for size in (1, 32, 128):
        print(f"decode graph of {size} sequences: replay {host_us(forward.graphs[(size, 1)].graph.replay):.1f} us")
    for tokens in (64, 1024):
        print(f"mixed graph of {tokens} tokens: replay {host_us(forward.mixed_graphs[tokens].graph.replay, 30):.1f} us")


if __name__ == "__main__":
    main()
