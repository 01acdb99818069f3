"""Prefill/decode disaggregation on two GPUs of one host (issue 23): ERNIE-4.5-0.3B's shape with
random weights (``--load-format dummy``, the same weights in every process), a real
``redis-server``, ``fd router``.

    python backends/cuda/benchmarks/pd_serve.py equal --redis BIN [--protocol tcp|nixl|cuda_ipc]
    python backends/cuda/benchmarks/pd_serve.py bench --redis BIN [--protocol P] [--concurrency 16 64 128]
    python backends/cuda/benchmarks/pd_serve.py link
    python backends/cuda/benchmarks/pd_serve.py stage [--dtype float32]

``equal``: float32; a plain instance on GPU 0 beside a prefill instance on GPU 0 and a decode
instance on GPU 1 behind the router; 32 greedy requests of 100 to 2,000 random prompt tokens,
one at a time, to the plain instance and through the router: the texts must be equal; then the
KV transfer per request (bytes, send-to-acknowledgement time, staging out of GPU 0 and into
GPU 1) from the instances' ``/metrics``. ``bench``: bfloat16; ``fd bench serve`` with 2,000-token
prompts and 400 output tokens over a concurrency sweep against (a) the prefill/decode pair and
(b) two mixed instances (GPU 0 and GPU 1) behind the router: output tokens/s, TPOT and TTFT
percentiles, the best output tokens/s at TPOT p50 <= 50 ms. ``link``: pinned host <-> GPU copy
bandwidth, the link the host-staged transfer crosses. ``stage``: the prefill side's staging of
one request's blocks (``ModelRunner.export_kv``), timed alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))

from moe_serve import MULTICAST_OFF  # noqa: E402 - NVLink multicast stays off in every process (KINDS.md)
from server_process import bench_serve, free_port, start, stop, wait_ready  # benchmarks/' helper

PROMPT, OUTPUT, TPOT_LIMIT_MS = 2000, 400, 50.0


def gpus(protocol: str) -> tuple[str, str]:
    """CUDA_VISIBLE_DEVICES of the prefill and the decode instance: each runs on its first; a
    device connector (cuda_ipc) needs the other's GPU visible too."""
    return ("0,1", "1,0") if protocol == "cuda_ipc" else ("0", "1")


def model_folder(folder: Path) -> Path:
    from e2e import whole_vocabulary_tokenizer
    from transformers import Ernie4_5Config

    from tests import checkpoints
    from tests.checkpoints import ERNIE_45_03B

    path = checkpoints.make_config_only(folder, Ernie4_5Config, "ernie03b", **ERNIE_45_03B,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    whole_vocabulary_tokenizer(path, ERNIE_45_03B["vocab_size"])
    return path


class Cluster:
    """Processes started for one measurement, stopped together."""

    def __init__(self, folder: Path, model: Path, redis: str | None) -> None:
        self.folder, self.model, self.procs = folder, model, []
        self.redis_port = None
        if redis:
            self.redis_port = free_port()
            env = {**os.environ, "LD_LIBRARY_PATH": str(Path(redis).parent)}
            proc = subprocess.Popen([redis, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", str(folder)], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            self.procs.append(proc)
            time.sleep(0.5)
            if proc.poll() is not None:
                raise SystemExit(f"redis-server exited with {proc.returncode}")

    def serve(self, name: str, gpu: str, *args: str, router: bool = False) -> int:
        port = free_port()
        if router:
            cmd = [sys.executable, "-m", "fd_core.entrypoints.cli", "router", "--model", str(self.model),
                   "--port", str(port), "--scheduler-port", str(self.redis_port), "--scheduler-topic", "pd"]
        else:
            cmd = [sys.executable, "-m", "fd_core.entrypoints.cli", "serve", "--model", str(self.model),
                   "--load-format", "dummy", "--device", "cuda", "--port", str(port), *args]
        log = self.folder / f"{name}.log"
        proc = start(cmd, str(log), env={**MULTICAST_OFF, "CUDA_VISIBLE_DEVICES": gpu})
        self.procs.append(proc)
        self.logs = getattr(self, "logs", []) + [(name, proc, port, log)]
        return port

    def wait(self) -> None:
        for name, proc, port, log in self.logs:
            if not wait_ready(proc, port, limit=600):
                raise SystemExit(f"{name} did not come up; its log ends:\n{log.read_text()[-3000:]}")

    def cluster_args(self, role: str, protocol: str = "tcp") -> list[str]:
        return ["--scheduler-name", "splitwise" if role != "mixed" else "global", "--scheduler-port",
                str(self.redis_port), "--scheduler-topic", "pd", "--role", role, "--cache-transfer-protocol", protocol]

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


def post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read())


def metrics(port: int) -> dict[str, float]:
    from tests.servers import plain_samples

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        return plain_samples(r.read().decode())


def run_equal(args, folder: Path, model: Path) -> None:
    cluster = Cluster(folder, model, args.redis)
    common = ["--dtype", "float32", "--max-model-len", "4096", "--gpu-memory-utilization", "0.3"]
    try:
        plain = cluster.serve("plain", "0", *common)
        p_gpus, d_gpus = gpus(args.protocol)
        cluster.serve("prefill", p_gpus, *common, *cluster.cluster_args("prefill", args.protocol))
        decode = cluster.serve("decode", d_gpus, *common, *cluster.cluster_args("decode", args.protocol))
        cluster.wait()
        router = cluster.serve("router", "", router=True)
        cluster.wait()
        prefill = cluster.logs[1][2]
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 103424) for _ in range(rng.randrange(100, 2001))] for _ in range(32)]
        same, began = 0, time.perf_counter()
        for prompt in prompts:
            body = {"model": str(model), "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            a, b = post(plain, body)["choices"][0]["text"], post(router, body)["choices"][0]["text"]
            same += a == b
        print(f"[{args.protocol}] float32 greedy, 32 requests of 100-2000 prompt tokens, 32 output tokens: "
              f"{same}/32 texts equal to the plain instance's ({time.perf_counter() - began:.0f} s)", flush=True)
        p, d = metrics(prefill), metrics(decode)
        n = p.get("fd:kv_transfers_total", 0)
        tokens = sum(len(x) for x in prompts)
        if n:
            mib = p["fd:kv_transfer_bytes_total"] / 2**20
            send = p["fd:kv_transfer_seconds_total"]
            out, into = p["fd:kv_transfer_staging_seconds_total"], d["fd:kv_transfer_staging_seconds_total"]
            print(f"[{args.protocol}] {n:.0f} transfers, {mib / n:.1f} MiB a request on average ({tokens / 32:.0f} prompt "
                  f"tokens, float32), send {send / n * 1e3:.1f} ms ({mib / send / 1024:.2f} GiB/s), staging out of GPU 0 "
                  f"{out / n * 1e3:.1f} ms ({mib / out / 1024:.2f} GiB/s), into GPU 1 {into / n * 1e3:.1f} ms "
                  f"({mib / into / 1024:.2f} GiB/s); end to end {(send + out + into) / n * 1e3:.1f} ms a request "
                  f"({mib / (send + out + into) / 1024:.2f} GiB/s)", flush=True)
        print(f"[{args.protocol}] decode instance: prompt tokens computed {d.get('fd:prompt_tokens_computed_total')}, "
              f"generated {d.get('fd:generation_tokens_total')}; prefill instance generated "
              f"{p.get('fd:generation_tokens_total')}", flush=True)
    finally:
        cluster.close()


def bench(port: int, model: Path, concurrency: int) -> dict:
    return bench_serve(port, concurrency, max(2 * concurrency, 16), PROMPT, OUTPUT, 2, ["--model", str(model)])


def _ms(r: dict, metric: str, pct: str) -> float:
    value = r[f"{metric}_ms"][pct]
    return float("inf") if value is None else float(value)


def run_bench(args, folder: Path, model: Path) -> None:
    common = ["--dtype", "bfloat16", "--max-model-len", str(PROMPT + OUTPUT + 64), "--max-num-seqs",
              str(max(args.concurrency))]
    for setup in args.setups:
        cluster = Cluster(folder, model, args.redis)
        try:
            began = time.perf_counter()
            if setup == "pd":
                p_gpus, d_gpus = gpus(args.protocol)
                prefill = cluster.serve("prefill", p_gpus, *common, *cluster.cluster_args("prefill", args.protocol))
                cluster.serve("decode", d_gpus, *common, *cluster.cluster_args("decode", args.protocol))
            else:
                prefill = cluster.serve("mixed0", "0", *common, *cluster.cluster_args("mixed"))
                cluster.serve("mixed1", "1", *common, *cluster.cluster_args("mixed"))
            cluster.wait()
            router = cluster.serve("router", "", router=True)
            cluster.wait()
            print(f"{setup}: up in {time.perf_counter() - began:.0f} s", flush=True)
            rows = []
            for c in args.concurrency:
                r = bench(router, model, c)
                rows.append((c, r))
                print(f"{setup} concurrency {c}: {r['completed']} done, {r['failed']} failed, "
                      f"{r['output_tokens_per_s']:.0f} output tokens/s, TPOT p50 {_ms(r, 'tpot', 'p50'):.1f} ms, "
                      f"TTFT p99 {_ms(r, 'ttft', 'p99'):.0f} ms", flush=True)
            print(f"| {setup} | clients | output tokens/s | TPOT p50 / p99 ms | TTFT p50 / p99 ms |")
            for c, r in rows:
                print(f"| {setup} | {c} | {r['output_tokens_per_s']:.0f} | {_ms(r, 'tpot', 'p50'):.1f} / "
                      f"{_ms(r, 'tpot', 'p99'):.1f} | {_ms(r, 'ttft', 'p50'):.0f} / {_ms(r, 'ttft', 'p99'):.0f} |")
            ok = [(c, r) for c, r in rows if _ms(r, "tpot", "p50") <= TPOT_LIMIT_MS and not r["failed"]]
            if ok:
                c, r = max(ok, key=lambda item: item[1]["output_tokens_per_s"])
                print(f"{setup}: best under TPOT p50 <= {TPOT_LIMIT_MS:g} ms: {r['output_tokens_per_s']:.0f} output "
                      f"tokens/s at {c} clients, TTFT p99 {_ms(r, 'ttft', 'p99'):.0f} ms", flush=True)
            if setup == "pd":
                p = metrics(prefill)
                n = p.get("fd:kv_transfers_total", 0) or 1
                print(f"pd: {n:.0f} transfers, {p.get('fd:kv_transfer_bytes_total', 0) / n / 2**20:.1f} MiB each, send "
                      f"{p.get('fd:kv_transfer_seconds_total', 0) / n * 1e3:.1f} ms, staging out "
                      f"{p.get('fd:kv_transfer_staging_seconds_total', 0) / n * 1e3:.1f} ms a request", flush=True)
        finally:
            cluster.close()


def run_link(args, folder: Path, model: Path) -> None:
    import torch

    size = 256 << 20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    for gpu in range(torch.cuda.device_count()):
        dev = torch.empty(size, dtype=torch.uint8, device=f"cuda:{gpu}")
        for name, dst, src in (("host -> GPU", dev, host), ("GPU -> host", host, dev)):
            dst.copy_(src)
            torch.cuda.synchronize(gpu)
            began = time.perf_counter()
            for _ in range(10):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(gpu)
            print(f"GPU {gpu}: {name} pinned copies at {10 * size / (time.perf_counter() - began) / 2**30:.1f} GiB/s")
    if torch.cuda.device_count() > 1:
        a, b = (torch.empty(size, dtype=torch.uint8, device=f"cuda:{i}") for i in (0, 1))
        b.copy_(a)
        torch.cuda.synchronize(1)
        began = time.perf_counter()
        for _ in range(10):
            b.copy_(a)
        torch.cuda.synchronize(1)
        print(f"GPU 0 -> GPU 1 copies at {10 * size / (time.perf_counter() - began) / 2**30:.1f} GiB/s (peer "
              f"access {torch.cuda.can_device_access_peer(0, 1)})")


def run_stage(args, folder: Path, model: Path) -> None:
    """``ModelRunner.export_kv`` of a 2,000-token prompt's blocks on one GPU: with a fresh staging
    buffer each time (the first version) and with the kept one, and its two parts."""
    from fd_core import LLM

    llm = LLM(model=str(model), load_format="dummy", device="cuda", dtype=args.dtype, max_model_len=4096,
              gpu_memory_utilization=0.3)
    runner, memory = llm.engine.runner, llm.engine.memory
    blocks = list(range(1, 1 + PROMPT // runner.block_size))
    for variant in ("fresh", "kept", "fresh", "kept"):
        if variant == "fresh":
            runner._staging_blocks = 0
        began = time.perf_counter()
        out = runner.export_kv(blocks)
        exported = time.perf_counter()
        memory.swap_blocks(runner.kv_caches, runner._staging, runner.block_size, list(zip(blocks, range(len(blocks)))))
        swapped = time.perf_counter()
        rows = len(blocks) * runner.block_size
        [memory.to_numpy(t[:rows]) for pair in runner._staging for t in pair]
        done = time.perf_counter()
        print(f"{args.dtype} {variant}: export_kv {1e3 * (exported - began):.1f} ms for "
              f"{sum(a.nbytes for a in out) / 2**20:.1f} MiB; of which swap_blocks {1e3 * (swapped - exported):.1f} ms, "
              f"to_numpy {1e3 * (done - swapped):.1f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("equal", "bench", "link", "stage"))
    parser.add_argument("--dtype", default="bfloat16", help="stage: the KV cache's dtype")
    parser.add_argument("--redis", default=None, help="the redis-server binary (its libraries beside it)")
    parser.add_argument("--protocol", default="tcp")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--setups", nargs="+", default=["pd", "mixed"], choices=("pd", "mixed"))
    args = parser.parse_args()
    # a `timeout` around this script must still stop the servers it started (Cluster.close)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    os.environ.update(MULTICAST_OFF)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    folder = Path(tempfile.mkdtemp(prefix="pd-"))
    model = model_folder(folder) if args.mode != "link" else folder
    {"equal": run_equal, "bench": run_bench, "link": run_link, "stage": run_stage}[args.mode](args, folder, model)


if __name__ == "__main__":
    main()
