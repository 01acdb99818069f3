"""The attention kernel over a bfloat16 cache against int8 / fp8_e4m3 caches: a prefill step
(16 prompts of 1,024 tokens) and a decode step (128 sequences at 1,100 cached tokens), ERNIE-4.5-0.3B's
heads (16 query / 2 KV of 128). Microseconds per call, CUDA events, median of 20.

    python backends/cuda/benchmarks/bench_kv_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from fd_core.interfaces.ops import AttentionMetadata
from fd_core.quantization.kv_cache import cache_layout

from fd_backend_cuda.kernels.attention import paged_attention

HQ, HK, D, BS = 16, 2, 128, 16


def step(seqs: list[tuple[int, int]]) -> AttentionMetadata:
    need = [-(-(c + n) // BS) for c, n in seqs]
    tables = np.zeros((len(seqs), max(need)), dtype=np.int64)
    start = 0
    for i, b in enumerate(need):
        tables[i, :b] = np.arange(start, start + b)
        start += b
    slots = [tables[i][p // BS] * BS + p % BS for i, (c, n) in enumerate(seqs) for p in range(c, c + n)]
    return AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum([n for _, n in seqs])]).astype(np.int64),
        seq_lens=np.array([c + n for c, n in seqs], dtype=np.int64),
        context_lens=np.array([c for c, _ in seqs], dtype=np.int64), block_tables=tables,
        slot_mapping=np.array(slots, dtype=np.int64), block_size=BS)


def timed(fn) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return float(np.median(times))


def main() -> None:
    print(torch.cuda.get_device_name(0))
    for name, seqs in (("prefill 16 x 1024", [(0, 1024)] * 16), ("decode 128 x 1100", [(1100, 1)] * 128)):
        meta = step(seqs)
        n = int(meta.query_start_loc[-1])
        slots = int(meta.block_tables.max() + 1) * BS
        q = torch.randn(n, HQ, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, HK, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, HK, D, device="cuda", dtype=torch.bfloat16)
        row = {}
        for kv in ("bfloat16", "int8", "fp8_e4m3"):
            width, storage = cache_layout(kv, D)
            caches = tuple(torch.zeros((slots, HK, width), dtype=getattr(torch, storage), device="cuda") for _ in range(2))
            meta.device.clear()
            row[kv] = timed(lambda caches=caches: paged_attention(q, k, v, caches, meta, D**-0.5))
        print(f"{name}: " + ", ".join(f"{kv} {t:.1f} us" for kv, t in row.items()), flush=True)


if __name__ == "__main__":
    main()
