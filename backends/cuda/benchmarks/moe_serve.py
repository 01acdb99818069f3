"""ERNIE-4.5-21B-A3B's shape at full depth with random weights (``--load-format dummy``): ``fd
serve`` on one GPU under ``fd bench serve`` over a concurrency sweep, 1,100-token prompts, and
transformers' ``generate()`` on the same shape at batch 1 and 32.

    python backends/cuda/benchmarks/moe_serve.py fd [--quantization wint4] [--concurrency 1 8 32 64]
    python backends/cuda/benchmarks/moe_serve.py hf [--batches 1 32]
    python backends/cuda/benchmarks/moe_serve.py fd --tensor-parallel-size 2 [--enable-expert-parallel]
    python backends/cuda/benchmarks/moe_serve.py fd --shape 300b --layers 8 --quantization wint4 --tensor-parallel-size 2

``--shape 300b``: ERNIE-4.5-300B-A47B's (``--layers`` keeps its three dense layers first; the
TPOT bound is then 50 ms, the seeds' condition). ``--tensor-parallel-size`` runs one process per
GPU over NCCL with NVLink multicast off (the device machine's KINDS.md).

``fd``: for each concurrency C, ``max(2 C, 8)`` requests of 1,100 prompt tokens and 128 output
tokens (greedy, EOS ignored) after two warm-up requests; prints output tokens/s and TPOT / TTFT
percentiles, and the highest output tokens/s whose TPOT p50 is at most 25 ms. The weights are
drawn at load, so no 42 GB checkpoint is written. ``hf``: ``AutoModelForCausalLM.from_config``
in bfloat16 on the GPU (random weights), ``generate()`` of 128 tokens after the same prompts:
output tokens/s and the time per output token after the first.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))

from server_process import bench_serve, free_port, start, stop, wait_ready  # benchmarks/' helper
from tests.checkpoints import ERNIE_45_21B_A3B, ERNIE_45_300B_A47B

PROMPT, OUTPUT = 1100, 128
SHAPES = {"21b": (ERNIE_45_21B_A3B, 25.0), "300b": (ERNIE_45_300B_A47B, 50.0)}  # shape, TPOT p50 bound (ms)
# NVLink multicast stays off in every process (the device machine's KINDS.md)
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def model_folder(folder: Path, shape: str = "21b", layers: int | None = None) -> Path:
    """config.json and a tokenizer naming every id: all ``--load-format dummy`` needs."""
    from e2e import whole_vocabulary_tokenizer
    from transformers import Ernie4_5_MoeConfig

    from tests import checkpoints

    settings = dict(SHAPES[shape][0])
    if layers is not None:
        settings["num_hidden_layers"] = layers
        if "moe_layer_end_index" in settings:
            settings["moe_layer_end_index"] = layers - 1
    path = checkpoints.make_config_only(folder, Ernie4_5_MoeConfig, f"ernie45_{shape}", **settings,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    whole_vocabulary_tokenizer(path, settings["vocab_size"])
    return path


def run_fd(args, folder: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "fd_core.entrypoints.cli", "serve", "--model", str(folder), "--load-format",
           "dummy", "--device", "cuda", "--dtype", "bfloat16", "--max-num-seqs", str(max(args.concurrency)),
           "--max-model-len", str(PROMPT + OUTPUT + 64), "--port", str(port)]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    if args.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(args.tensor_parallel_size)]
    if args.enable_expert_parallel:
        cmd += ["--enable-expert-parallel"]
    if args.async_scheduling is not None:  # the server's default otherwise (on where the backend can)
        cmd += ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    limit = SHAPES[args.shape][1]
    log = folder / "server.log"
    began = time.perf_counter()
    server = start(cmd, str(log), env=MULTICAST_OFF)
    try:
        if not wait_ready(server, port, limit=600):
            raise SystemExit(f"fd serve did not come up; its log ends:\n{log.read_text()[-3000:]}")
        print(f"server ready in {time.perf_counter() - began:.0f} s ({args.shape}, {args.layers or 'all'} layers, "
              f"{args.quantization or 'bfloat16'}, TP {args.tensor_parallel_size}, EP "
              f"{'on' if args.enable_expert_parallel else 'off'}, async scheduling "
              f"{'default' if args.async_scheduling is None else 'on' if args.async_scheduling else 'off'})", flush=True)
        for line in log.read_text().splitlines():  # weights and KV cache per GPU (rank 0's weights)
            if "loading weights: done" in line or "KV cache:" in line:
                print("  " + line.strip(), flush=True)
        rows = []
        for c in args.concurrency:
            r = bench_serve(port, c, max(2 * c, 8), PROMPT, OUTPUT, 2)
            rows.append((c, r))
            print(f"concurrency {c}: {r['completed']} done, {r['failed']} failed, "
                  f"{r['output_tokens_per_s']:.0f} output tokens/s, TPOT p50 {_ms(r, 'tpot', 'p50'):.1f} ms", flush=True)
        ok = [(c, r) for c, r in rows if _ms(r, "tpot", "p50") <= limit]
        print("| clients | output tokens/s | TPOT p50 / p99 ms | TTFT p50 / p99 ms |")
        print("|---|---|---|---|")
        for c, r in rows:
            print(f"| {c} | {r['output_tokens_per_s']:.0f} | {_ms(r, 'tpot', 'p50'):.1f} / {_ms(r, 'tpot', 'p99'):.1f} "
                  f"| {_ms(r, 'ttft', 'p50'):.0f} / {_ms(r, 'ttft', 'p99'):.0f} |")
        if ok:
            c, r = max(ok, key=lambda item: item[1]["output_tokens_per_s"])
            print(f"best under TPOT p50 <= {limit} ms: {r['output_tokens_per_s']:.0f} output tokens/s "
                  f"at {c} clients")
        else:
            print(f"no concurrency kept TPOT p50 <= {limit} ms")
    finally:
        stop(server)


def _ms(r: dict, metric: str, pct: str) -> float:
    value = r[f"{metric}_ms"][pct]
    return float("inf") if value is None else float(value)


def run_hf(args, folder: Path) -> None:
    import numpy as np
    import torch
    from e2e import timed_generate
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder))
    start = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    print(f"transformers model built in {time.perf_counter() - start:.0f} s", flush=True)
    rng = np.random.default_rng(0)

    def generate(batch: int, new: int) -> float:
        return timed_generate(model, rng.integers(3, config.vocab_size, size=(batch, PROMPT)).tolist(), new)

    generate(1, 4)
    for batch in args.batches:
        first = generate(batch, 1)
        full = generate(batch, OUTPUT)
        print(f"transformers generate(), batch {batch}: {batch * OUTPUT / full:.1f} output tokens/s, "
              f"{(full - first) / (OUTPUT - 1) * 1e3:.1f} ms per output token after the first "
              f"(prefill of {PROMPT} tokens: {first:.2f} s)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("side", choices=("fd", "hf"))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="21b")
    parser.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape's")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    args = parser.parse_args()
    folder = model_folder(Path(tempfile.mkdtemp(prefix=f"ernie{args.shape}-")), args.shape, args.layers)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    (run_fd if args.side == "fd" else run_hf)(args, folder)


if __name__ == "__main__":
    main()
