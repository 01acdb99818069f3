"""Where a stream's token gaps come from under load: ``fd serve --device cuda`` of the ERNIE-4.5-0.3B
shape (``e2e.py``'s model) under ``fd bench serve``, one server per variant of its flags.

    python backends/cuda/benchmarks/serve_latency.py [--clients 128] [--prompts 4096] \
        [--variant "" --variant "--max-num-batched-tokens 2048" ...]

For each variant: output tokens/s, TPOT p50 / p99, the client's ITL (the gap between streamed
chunks) p50 / p99 and its ratio to TPOT p50 (issue 21 asks for at most 3x), the tokens a chunk
carried on average (above 1: the HTTP process fell behind the engine and sent several steps'
tokens in one chunk, ``fd_server.streams``), and the server's own token gaps (the
``fd:inter_token_latency_seconds`` histogram, taken when each step's output reaches the HTTP
process): p50 and p99 interpolated in its buckets, and the share over 10 and 25 ms. A gap the
server saw is the engine's; one only the client saw is the HTTP path's or the client's. The load
comes from ``--client-processes`` processes (4 by default): one parses about 20,000 chunks a
second at most, and past that the gaps it measures are its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "benchmarks"))

from server_process import bench_serve, free_port, start, stop, wait_ready  # benchmarks/' helper

from fd_core.bench.stats import percentile

PROMPT, OUTPUT = 256, 128
TRACE_SITE = Path(__file__).resolve().parent / "trace_site"
GAP = re.compile(r'^fd:inter_token_latency_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} ([0-9.e+]+)$', re.M)


def gap_buckets(port: int) -> dict[float, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {float(le): float(n) for le, n in GAP.findall(text)}


def quantile(buckets: dict[float, float], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket that holds the q-th observation."""
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    rank, below, lower = q * total, 0.0, 0.0
    for edge in edges:
        if buckets[edge] >= rank:
            if math.isinf(edge):
                return lower
            return lower + (edge - lower) * (rank - below) / max(buckets[edge] - below, 1e-9)
        below, lower = buckets[edge], edge
    return lower


def cpu_times() -> tuple[int, int]:
    """The machine's busy and total CPU time so far (``/proc/stat``, all cores, in ticks)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return sum(ticks) - idle, sum(ticks)


def run_variant(model: Path, flags: str, args) -> None:
    port = free_port()
    words = shlex.split(flags)
    # leading NAME=value words are the server's environment (e.g. FD_CUDA_MIXED_GRAPH_TOKENS=0)
    settings = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        settings[name] = value
    cmd = [sys.executable, "-m", "fd_core.entrypoints.cli", "serve", "--model", str(model), "--device", args.device,
           "--max-num-seqs", str(args.clients), "--max-model-len", "4096",
           "--port", str(port), "--dtype", "bfloat16" if args.device == "cuda" else "float32", *words]
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = settings or None
    if args.trace:
        traces = Path(tempfile.mkdtemp(prefix="fd-trace-"))
        env = {**settings, "FD_TRACE_DIR": str(traces), "FD_TRACE_PROFILE": "1" if args.profile_steps else "",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(TRACE_SITE), os.environ.get("PYTHONPATH")]))}
    server = start(cmd, str(log), env=env)
    try:
        if not wait_ready(server, port, limit=300):
            raise SystemExit(f"fd serve did not come up; its log ends:\n{log.read_text()[-3000:]}")
        load = ["--client-processes", str(args.client_processes)]
        bench_serve(port, args.clients, 2 * args.clients, PROMPT, OUTPUT, 4, load)  # warm: graphs, kernels, allocator
        before = gap_buckets(port)
        began, cpu_before = time.perf_counter(), cpu_times()
        r = bench_serve(port, args.clients, args.prompts, PROMPT, OUTPUT, 4, load)
        ended, cpu_after = time.perf_counter(), cpu_times()
        wall = ended - began
        after = gap_buckets(port)
        if args.trace:
            time.sleep(1.5)  # the tracer writes every half second
    finally:
        stop(server)
    gaps = {le: after[le] - before.get(le, 0.0) for le in after}
    total = gaps.get(float("inf"), 0.0) or 1.0
    over = {t: 1 - gaps.get(t, 0.0) / total for t in (0.01, 0.025)}
    server50, server99 = (1000 * quantile(gaps, q) for q in (0.5, 0.99))
    tokens = sum(r["output_lens"])
    chunks = sum(len(itl) + 1 for itl, n in zip(r["itls"], r["output_lens"]) if n)
    tpot50, itl50, itl99 = r["tpot_ms"]["p50"], r["itl_ms"]["p50"], r["itl_ms"]["p99"]
    print(f"| `{flags or '(defaults)'}` | {r['completed']} in {wall:.0f} s | {r['output_tokens_per_s']:.0f} "
          f"| {tpot50:.2f} / {r['tpot_ms']['p99']:.2f} | {itl50:.2f} / {itl99:.2f} | {itl99 / tpot50:.1f}x "
          f"| {tokens / max(chunks, 1):.2f} | {server50:.1f} / {server99:.1f} "
          f"| {100 * over[0.01]:.2f}% / {100 * over[0.025]:.2f}% "
          f"| {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} |", flush=True)
    busy = [b - a for a, b in zip(cpu_before, cpu_after)]
    print(f"  - the host's CPUs during the run: {100 * busy[0] / max(busy[1], 1):.0f}% busy over {os.cpu_count()} "
          f"cores; load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.trace:
        print(trace_summary(traces, began, ended), flush=True)


def trace_summary(folder: Path, began: float, ended: float) -> str:
    """The engine core's steps and every process's garbage collections within the measured run
    (``trace_site/sitecustomize.py``), as lines under the variant's row."""
    lines = []
    for path in sorted(folder.glob("trace.*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        trace = {"argv": rows[0]["argv"] if rows and isinstance(rows[0], dict) else [], "gc": [], "steps": [],
                 "compiles": [], "devices": []}
        for row in rows:
            if isinstance(row, list):
                trace[row[0]].append(row[1:])
        pauses = sorted(s for start, s, _ in trace["gc"] if began <= start <= ended)
        name = f"pid {path.name.split('.')[1]} ({' '.join(trace['argv'][:2])[-40:]})"
        if pauses:
            lines.append(f"  - {name}: {len(pauses)} collections, {sum(p > 0.005 for p in pauses)} over 5 ms, "
                         f"longest {1000 * pauses[-1]:.1f} ms, {1000 * sum(pauses):.0f} ms in all")
        steps = [s for s in trace["steps"] if began <= s[0] <= ended]
        if not steps:
            continue
        ms = [1000 * s[1] for s in steps]
        starts = [s[0] for s in steps]
        between = [1000 * (b - a) for a, b in zip(starts, starts[1:])] or [0.0]
        slow = [s for s in steps if s[1] > 0.010]
        lines.append(f"  - engine core: {len(steps)} steps; EngineCore.step p50 {percentile(ms, 50):.2f} ms, p99 "
                     f"{percentile(ms, 99):.2f}, max {max(ms):.1f}; step start to start p50 "
                     f"{percentile(between, 50):.2f} ms, p99 {percentile(between, 99):.2f}, max "
                     f"{max(between):.1f}; {len(slow)} steps over 10 ms, with "
                     f"{sum(s[2] for s in slow) / max(len(slow), 1):.0f} tokens and "
                     f"{sum(s[3] for s in slow) / max(len(slow), 1):.0f} sequences on average (all steps: "
                     f"{sum(s[2] for s in steps) / len(steps):.0f} / {sum(s[3] for s in steps) / len(steps):.0f}); "
                     f"cudaMalloc in {sum(s[4] > 0 for s in steps)} steps ({sum(s[4] > 0 for s in slow)} of the "
                     f"slow), allocator retries in {sum(s[5] > 0 for s in steps)} ({sum(s[5] > 0 for s in slow)}), "
                     f"pinned host allocations in {sum(s[6] > 0 for s in steps if len(s) > 6)} "
                     f"({sum(s[6] > 0 for s in slow if len(s) > 6)})")
        compiled = [c for c in trace.get("compiles", []) if began <= c[0] <= ended]
        in_slow = sum(any(s[0] <= c[0] <= s[0] + s[1] for s in slow) for c in compiled)
        lines.append(f"  - Triton compilations during the run: {len(compiled)} ({in_slow} inside slow steps): "
                     + ", ".join(sorted({c[1] for c in compiled})))
        timed = [s for s in slow if len(s) > 7]
        if timed:
            labels = ("schedule", "launch", "read", "wait", "cpu", "process_cpu")
            lines.append("  - the slow steps' time, ms on average: " + ", ".join(
                f"{label} {1000 * sum(s[7].get(label, 0.0) for s in timed) / len(timed):.2f}" for label in labels)
                + "; all steps: " + ", ".join(
                f"{label} {1000 * sum(s[7].get(label, 0.0) for s in steps if len(s) > 7) / len(steps):.2f}"
                for label in labels))
        lags = {began: (first, last) for began, first, last in trace["devices"]}
        slow_lags = [lags[s[0]] for s in slow if s[0] in lags]
        if slow_lags:
            every = list(lags.values())
            lines.append(f"  - the device's lag behind the host, ms at a step's start / end: slow steps "
                         f"{1000 * sum(a for a, _ in slow_lags) / len(slow_lags):.2f} / "
                         f"{1000 * sum(b for _, b in slow_lags) / len(slow_lags):.2f}, all steps "
                         f"{1000 * sum(a for a, _ in every) / len(every):.2f} / "
                         f"{1000 * sum(b for _, b in every) / len(every):.2f} (growing: the device was the slower "
                         f"side; near zero at the end: it waited for the host)")
        if timed:
            lines.append(f"  - involuntary context switches of the engine's thread: "
                         f"{sum(s[7].get('switches', 0) for s in timed) / len(timed):.1f} a slow step, "
                         f"{sum(s[7].get('switches', 0) for s in steps if len(s) > 7) / len(steps):.2f} a step")
        worst = sorted(steps, key=lambda s: -s[1])[:5]
        lines.append("  - slowest steps (ms, tokens, sequences, cudaMallocs, retries, host allocations, phases ms): "
                     + "; ".join(", ".join([f"{1000 * s[1]:.1f}", *map(str, s[2:7]), *(
                         f"{k} {v:.0f}" if k == "switches" else f"{k} {1000 * v:.1f}"
                         for k, v in (s[7] if len(s) > 7 else {}).items())]) for s in worst))
    for path in sorted(folder.glob("profile.*.txt")):
        lines.append(f"  - host profile of the engine's steps ({path.name}):\n" + path.read_text())
    return "\n".join(lines) or "  - no trace written"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/fd-ernie-0.3b"),
                    help="a checkpoint folder to serve, or where to build the ERNIE-4.5-0.3B shape")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4096, help="requests in the measured run")
    ap.add_argument("--variant", action="append", default=None,
                    help="extra fd serve flags (repeatable), after any NAME=value settings of its environment")
    ap.add_argument("--trace", action="store_true",
                    help="record the engine core's steps and every server process's garbage collections "
                         "(trace_site/sitecustomize.py) and summarise them under each row")
    ap.add_argument("--profile-steps", action="store_true",
                    help="with --trace: cProfile the engine's steps that admit prompts and print the top functions")
    ap.add_argument("--client-processes", type=int, default=4,
                    help="fd bench serve's client processes: one parses ~20,000 chunks/s at most (its gaps "
                         "are then its own lag)")
    args = ap.parse_args()
    from e2e import build_model

    # a folder holding a checkpoint is served as it is (e.g. quantized.py's Llama-3-8B shape)
    model = args.model if (args.model / "config.json").exists() else build_model(args.model)
    print(f"{args.clients} clients from {args.client_processes} processes, {PROMPT} prompt / {OUTPUT} output tokens, "
          f"{args.prompts} requests per run")
    print("| fd serve flags | requests | output tokens/s | TPOT p50 / p99 ms | client ITL p50 / p99 ms "
          "| ITL p99 / TPOT p50 | tokens a chunk | server gap p50 / p99 ms | server gaps > 10 / 25 ms "
          "| TTFT p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for flags in args.variant or [""]:
        run_variant(model, flags, args)


if __name__ == "__main__":
    main()
