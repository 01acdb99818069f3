"""Rough GPU timings of the CUDA backend's Triton kernels (needs a CUDA device).

    python backends/cuda/benchmarks/bench_kernels.py [sample]

(``sample``: the sampler alone). Prints time per call and achieved bandwidth (memory-bound kernels, decode) or TFLOP/s
(prefill), with torch's own kernels alongside where torch has an equivalent.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from fd_core.interfaces.ops import AttentionMetadata, SamplingBatch
from fd_core.runtimes.torch import ops as torch_ops

from fd_backend_cuda import ops
from fd_backend_cuda.kernels.attention import paged_attention
from fd_backend_cuda.kernels.sampling import draw

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def ms(fn) -> float:
    fn()  # compile first: do_bench sizes its loops from the first call's time
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100)


def graphed_ms(fn, calls: int = 20) -> float:
    """``fn``'s GPU time: ``calls`` of it captured in one CUDA graph, the replay timed. A decode
    attention launch takes less GPU time than the host needs to launch it, so ``ms`` would time
    the host (~60 us a call on an H200 host, whatever the load)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return do_bench(graph.replay, warmup=10, rep=50) / calls


def line(name: str, t: float, extra: str) -> None:
    print(f"{name:58s} {t * 1e3:9.1f} us  {extra}", flush=True)


def batch(seqs, block_size, num_blocks, seed=0) -> AttentionMetadata:
    rng = np.random.default_rng(seed)
    pool = rng.permutation(num_blocks)
    used, slots = 0, []
    nbs = [-(-(c + q) // block_size) for c, q in seqs]
    width = max(nbs)
    bt = np.zeros((len(seqs), width), dtype=np.int64)
    for i, ((c, q), nb) in enumerate(zip(seqs, nbs, strict=True)):
        bt[i, :nb] = pool[used : used + nb]
        used += nb
        pos = np.arange(c, c + q)
        slots.append(bt[i][pos // block_size] * block_size + pos % block_size)
    qlens = np.array([q for _, q in seqs])
    ctx = np.array([c for c, _ in seqs])
    return AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64),
        seq_lens=(ctx + qlens).astype(np.int64),
        context_lens=ctx.astype(np.int64),
        block_tables=bt,
        slot_mapping=np.concatenate(slots).astype(np.int64),
        block_size=block_size,
    )


def bench_attention(name, seqs, hq=32, hk=8, d=128, block_size=16, num_splits=None, graphed=False) -> None:
    nb = sum(-(-(c + q) // block_size) for c, q in seqs) + 8
    meta = batch(seqs, block_size, nb)
    n = int(meta.query_start_loc[-1])
    q = torch.randn(n, hq, d, device=DEV, dtype=BF16)
    k = torch.randn(n, hk, d, device=DEV, dtype=BF16)
    v = torch.randn(n, hk, d, device=DEV, dtype=BF16)
    kc = torch.randn(nb * block_size, hk, d, device=DEV, dtype=BF16)
    vc = torch.randn(nb * block_size, hk, d, device=DEV, dtype=BF16)
    fn = lambda: paged_attention(q, k, v, (kc, vc), meta, d**-0.5, num_splits=num_splits)
    fn()
    t = graphed_ms(fn) if graphed else ms(fn)
    keys = int(meta.seq_lens.sum())
    kv_bytes = 2 * keys * hk * d * 2
    flops = sum(4 * q_ * (c + (q_ + 1) / 2) * hq * d for c, q_ in seqs)
    line(
        f"attention {name}",
        t,
        f"{kv_bytes / t / 1e6:7.0f} GB/s KV  {flops / t / 1e9:6.1f} TFLOP/s",
    )


def bench_sdpa_prefill(n, hq=32, hk=8, d=128) -> None:
    q = torch.randn(1, hq, n, d, device=DEV, dtype=BF16)
    k = torch.randn(1, hk, n, d, device=DEV, dtype=BF16)
    v = torch.randn(1, hk, n, d, device=DEV, dtype=BF16)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    t = ms(fn)
    flops = 4 * n * (n + 1) / 2 * hq * d
    line(
        f"torch sdpa causal prefill {n} (contiguous, reference)",
        t,
        f"{flops / t / 1e9:6.1f} TFLOP/s",
    )


def sampling_batch(rows: int, temperature: float, top_k: int, top_p: float) -> SamplingBatch:
    def col(value, dtype):
        return np.full(rows, value, dtype=dtype)

    empty = [np.zeros(0, dtype=np.int64)] * rows
    return SamplingBatch(
        temperature=col(temperature, np.float32),
        top_p=col(top_p, np.float32),
        top_k=col(top_k, np.int64),
        min_p=col(0.0, np.float32),
        presence_penalty=col(0.0, np.float32),
        frequency_penalty=col(0.0, np.float32),
        repetition_penalty=col(1.0, np.float32),
        seeds=np.arange(rows, dtype=np.int64),
        steps=col(17, np.int64),
        prompt_token_ids=empty,
        output_token_ids=empty,
        suppress_token_ids=empty,
    )


def bench_sample(rows: int = 128, vocab: int = 103424) -> None:
    """The ``sample`` op on one decode step's float32 logits: the Triton sampler (whole op, and
    its kernel alone) against the torch reference (whole op). Logits look like a model's: a few
    tokens far ahead of a Gaussian tail, so the top-p nucleus is small."""
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(rows, vocab, device=DEV, generator=g) * 2
    head = torch.randint(0, vocab, (rows, 20), device=DEV, generator=g)
    logits.scatter_(1, head, 6 + 6 * torch.rand(rows, 20, device=DEV, generator=g))
    mixes = {
        "greedy": (0.0, 0, 1.0),
        "temperature 1": (1.0, 0, 1.0),
        "top-p 0.9": (1.0, 0, 0.9),
        "top-k 50 + top-p 0.95": (0.8, 50, 0.95),
    }
    for name, params in mixes.items():
        batch = sampling_batch(rows, *params)
        top_k = np.where((batch.top_k > 0) & (batch.top_k < vocab), batch.top_k, 0)
        title = f"sample {rows}x{vocab} {name}"
        t = ms(lambda b=batch: ops.sample(logits, b))
        line(f"{title}: triton op", t, f"{rows * vocab * 4 / t / 1e6:7.0f} GB/s (one read)")
        t = ms(
            lambda b=batch, k=top_k: draw(
                logits, logits, b.temperature, k, b.top_p, b.min_p, b.seeds, b.steps
            )
        )
        line(f"{title}:   kernel only", t, "")
        t = ms(lambda b=batch: torch_ops.sample(logits, b))
        line(f"{title}: torch reference", t, "")


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    if sys.argv[1:] == ["sample"]:
        bench_sample()
        return
    x = torch.randn(4096, 4096, device=DEV, dtype=BF16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device=DEV, dtype=BF16)
    t = ms(lambda: ops.rms_norm(x, w, 1e-6, r))
    line(
        "rms_norm+residual 4096x4096 bf16",
        t,
        f"{4 * x.numel() * 2 / t / 1e6:7.0f} GB/s",
    )
    t = ms(lambda: torch.nn.functional.rms_norm(x, (4096,), w, 1e-6))
    line(
        "  torch F.rms_norm (no residual)",
        t,
        f"{2 * x.numel() * 2 / t / 1e6:7.0f} GB/s",
    )
    g = torch.randn(4096, 2 * 14336, device=DEV, dtype=BF16)
    t = ms(lambda: ops.silu_and_mul(g))
    line("silu_and_mul 4096x28672 bf16", t, f"{1.5 * g.numel() * 2 / t / 1e6:7.0f} GB/s")
    q = torch.randn(4096, 32, 128, device=DEV, dtype=BF16)
    k = torch.randn(4096, 8, 128, device=DEV, dtype=BF16)
    cs = torch.randn(8192, 128, device=DEV, dtype=torch.float32)
    pos = torch.randint(0, 8192, (4096,), device=DEV)
    for style in ("neox", "interleaved"):
        t = ms(lambda style=style: ops.rotary(pos, q, k, cs, style))
        nbytes = 2 * (q.numel() + k.numel()) * 2
        line(
            f"rotary {style} 4096 tok, 32/8 heads, D=R=128 bf16",
            t,
            f"{nbytes / t / 1e6:7.0f} GB/s",
        )

    bench_attention("decode 64 x ctx 2048", [(2048, 1)] * 64)
    bench_attention("decode 256 x ctx 1024", [(1024, 1)] * 256)
    bench_attention("decode 4 x ctx 16384 (auto split)", [(16384, 1)] * 4)
    bench_attention("decode 4 x ctx 16384 (no split)", [(16384, 1)] * 4, num_splits=1)
    bench_attention("prefill 1 x 4096 fresh", [(0, 4096)])
    bench_attention("prefill chunk 2048 over ctx 6144", [(6144, 2048)])
    bench_attention("mixed: 2048-chunk + 64 decodes ctx 2048", [(0, 2048)] + [(2048, 1)] * 64)
    bench_sdpa_prefill(4096)
    bench_sample()


if __name__ == "__main__":
    main()
