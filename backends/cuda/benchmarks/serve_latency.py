"""Where a stream's token gaps come from under load: ``fd serve --device cuda`` of the ERNIE-4.5-0.3B
shape (``e2e.py``'s model) under ``fd bench serve``, one server per variant of its flags.

    python backends/cuda/benchmarks/serve_latency.py [--clients 128] [--prompts 4096] \
        [--variant "" --variant "--max-num-batched-tokens 2048" ...]

For each variant: output tokens/s, TPOT p50 / p99, the client's ITL (the gap between streamed
chunks) p50 / p99 and its ratio to TPOT p50 (issue 21 asks for at most 3x), the tokens a chunk
carried on average (above 1: the HTTP process fell behind the engine and sent several steps'
tokens in one chunk, ``fd_server.streams``), and the server's own token gaps (the
``fd:inter_token_latency_seconds`` histogram, taken when each step's output reaches the HTTP
process): the share over 10 and 25 ms. A gap the server saw is the engine's; one only the client
saw is the HTTP path's or the client's.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
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

from server_process import free_port, start, stop, wait_ready  # benchmarks/' helper

PROMPT, OUTPUT = 256, 128
GAP = re.compile(r'^fd:inter_token_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)


def gap_buckets(port: int) -> dict[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {float(le): float(n) for le, n in GAP.findall(text)}


def bench(port: int, clients: int, prompts: int) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "bench", "serve", "--base-url",
                    f"http://127.0.0.1:{port}", "--endpoint", "completions", "--max-concurrency", str(clients),
                    "--num-prompts", str(prompts), "--input-len", str(PROMPT), "--output-len", str(OUTPUT),
                    "--num-warmups", "4", "--save-result", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_variant(model: Path, flags: str, args) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "fd_core.entrypoints.cli", "serve", "--model", str(model), "--device", args.device,
           "--max-num-seqs", str(args.clients), "--max-model-len", "4096",
           "--port", str(port), "--dtype", "bfloat16" if args.device == "cuda" else "float32", *shlex.split(flags)]
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    server = start(cmd, str(log))
    try:
        if not wait_ready(server, port, limit=300):
            raise SystemExit(f"fd serve did not come up; its log ends:\n{log.read_text()[-3000:]}")
        bench(port, args.clients, 2 * args.clients)  # warm: graphs, kernels, allocator
        before = gap_buckets(port)
        began = time.perf_counter()
        r = bench(port, args.clients, args.prompts)
        wall = time.perf_counter() - began
        after = gap_buckets(port)
    finally:
        stop(server)
    gaps = {le: after[le] - before.get(le, 0.0) for le in after}
    total = gaps.get(float("inf"), 0.0) or 1.0
    over = {t: 1 - gaps.get(t, 0.0) / total for t in (0.01, 0.025)}
    tokens = sum(r["output_lens"])
    chunks = sum(len(itl) + 1 for itl, n in zip(r["itls"], r["output_lens"]) if n)
    tpot50, itl50, itl99 = r["tpot_ms"]["p50"], r["itl_ms"]["p50"], r["itl_ms"]["p99"]
    print(f"| `{flags or '(defaults)'}` | {r['completed']} in {wall:.0f} s | {r['output_tokens_per_s']:.0f} "
          f"| {tpot50:.2f} / {r['tpot_ms']['p99']:.2f} | {itl50:.2f} / {itl99:.2f} | {itl99 / tpot50:.1f}x "
          f"| {tokens / max(chunks, 1):.2f} | {100 * over[0.01]:.2f}% / {100 * over[0.025]:.2f}% "
          f"| {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/fd-ernie-0.3b"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4096, help="requests in the measured run")
    ap.add_argument("--variant", action="append", default=None, help="extra fd serve flags (repeatable)")
    args = ap.parse_args()
    from e2e import build_model

    model = build_model(args.model)
    print(f"{args.clients} clients, {PROMPT} prompt / {OUTPUT} output tokens, {args.prompts} requests per run")
    print("| fd serve flags | requests | output tokens/s | TPOT p50 / p99 ms | client ITL p50 / p99 ms "
          "| ITL p99 / TPOT p50 | tokens a chunk | server gaps > 10 / 25 ms | TTFT p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for flags in args.variant or [""]:
        run_variant(model, flags, args)


if __name__ == "__main__":
    main()
