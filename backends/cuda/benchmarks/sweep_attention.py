"""Sweep the attention tile shapes on the local GPU (what ``attention._tiles`` should return).

python backends/cuda/benchmarks/sweep_attention.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kernels as bk

from fd_backend_cuda.kernels import attention

ORIGINAL = attention._tiles


def with_tiles(small=None, big=None):
    def tiles(group, head_dim, wide):
        s, b = ORIGINAL(group, head_dim, wide)
        return (s if small is None else {**s, **small}), (b if big is None else {**b, **big})

    attention._tiles = tiles


def head_dims() -> None:
    for d in (64, 256):
        for bm, bn, w, st in [(128, 64, 4, 3), (128, 64, 8, 3), (64, 32, 8, 2), (64, 64, 4, 2),
                              (64, 32, 4, 3), (128, 32, 8, 2)]:  # fmt: skip
            with_tiles(big={"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st})
            try:
                bk.bench_attention(f"D={d} prefill 4096 {bm}x{bn} w{w} s{st}", [(0, 4096)], d=d)
            except Exception as e:  # noqa: BLE001 (out of shared memory / registers)
                print(f"D={d} {bm}x{bn} w{w} s{st}: {type(e).__name__}: {str(e)[:80]}")
        attention._tiles = ORIGINAL
        bk.bench_attention(
            f"D={d} decode 64 x 2048 (chosen tiles)",
            [(2048, 1)] * 64,
            d=d,
            num_splits=1,
        )


def main() -> None:
    if "--head-dims" in sys.argv:
        return head_dims()
    print("prefill tiles (block_m, block_n, num_warps, num_stages)", flush=True)
    for bm, bn, w, st in [
        (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3),
        (64, 64, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3), (128, 32, 8, 3),
    ]:  # fmt: skip
        with_tiles(big={"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st})
        tag = f"{bm}x{bn} w{w} s{st}"
        bk.bench_attention(f"prefill 4096 fresh   {tag}", [(0, 4096)])
        bk.bench_attention(f"chunk 2048/ctx 6144  {tag}", [(6144, 2048)])
    print("decode tiles (block_n, num_warps, num_stages), split-K as planned; GPU time in a graph", flush=True)
    loads = [  # (name, sequences, query heads, KV heads)
        ("0.3B 128 x 1088", [(1088, 1)] * 128, 16, 2), ("0.3B 32 x 1088", [(1088, 1)] * 32, 16, 2),
        ("0.3B 1 x 1152", [(1152, 1)], 16, 2), ("8B 128 x 1088", [(1088, 1)] * 128, 32, 8),
    ]
    for bn, w, st in [
        (64, 4, 3), (64, 4, 2), (64, 2, 2), (32, 4, 3), (128, 4, 2), (128, 4, 3), (128, 2, 2), (128, 8, 2),
    ]:  # fmt: skip
        with_tiles(small={"block_n": bn, "num_warps": w, "num_stages": st})
        for name, seqs, hq, hk in loads:
            bk.bench_attention(f"decode {name:16s} n{bn} w{w} s{st}", seqs, hq=hq, hk=hk, graphed=True)
    attention._tiles = ORIGINAL


if __name__ == "__main__":
    main()
