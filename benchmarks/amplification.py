#!/usr/bin/env python3
"""What one amplification request does to everyone else's inter-token latency, through `fd serve`.

    python benchmarks/amplification.py [--model NAME] [--streams 16] [--window 20] [--out DIR]

STREAMS normal streams decode (short English prompts, long outputs). Once every one has
produced tokens, a WINDOW-second measurement starts; two seconds into it one request of the
kind below arrives (nothing, in the first run). The gaps between two tokens of the normal
streams that fall inside the window are their ITL; p50 / p99 / max are printed for each run,
with p99 relative to the run without amplification. Runs, all against one server:

- none          no extra request (the reference);
- issue         the 800-byte request of issue 14: 64 prompts × n=128, max_tokens 1 (8,192
                sequences), which the server now refuses at the door (400);
- n-heavy       the most the server takes in one request as n: two prompts × n=128
                (--max-sequences-per-request 256), 16 tokens each;
- prompt-heavy  the same as prompts: 256 three-token prompts, 16 tokens each.

By default the reference runs again at the end: its two p99 show how much the reference itself
varies between runs. Figures print as a table and go to DIR/amplification.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from server_process import free_port, start, stop, wait_ready  # this folder's helper

from fd_core.bench.serve import RequestResult, machine_info, make_prompts, percentile, send_one

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

AMPLIFIERS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "issue": {"prompt": [[1, 2, 3]] * 64, "n": 128, "max_tokens": 1},
    "n-heavy-1": {"prompt": [[1000, 2000, 3000], [1001, 2001, 3001]], "n": 128, "max_tokens": 1},
    "prompt-heavy-1": {"prompt": [[1000 + i, 2000, 3000] for i in range(256)], "max_tokens": 1},
    "n-heavy": {"prompt": [[1000, 2000, 3000], [1001, 2001, 3001]], "n": 128, "max_tokens": 16,
                "ignore_eos": True},
    "prompt-heavy": {"prompt": [[1000 + i, 2000, 3000] for i in range(256)], "max_tokens": 16, "ignore_eos": True},
}


async def run_case(port: int, model: str, amplifier: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1200) as client:
        results = [RequestResult() for _ in range(args.streams)]
        # every token must arrive as a chunk with text, or a gap would look longer than it was
        # (see benchmarks/scheduling.py): English prompts, special tokens kept as text
        streams = [asyncio.create_task(send_one(client, "/v1/completions",
                                                {"model": model, "prompt": prompt, "max_tokens": 4000,
                                                 "temperature": 0, "ignore_eos": True, "stream": True,
                                                 "skip_special_tokens": False}, "completions", 32, r))
                   for prompt, r in zip(make_prompts(args.streams, 24, args.seed), results)]
        while any(len(r.token_times) < 3 for r in results):
            if all(t.done() for t in streams):
                raise RuntimeError(f"the streams ended early: {[r.error for r in results]}")
            await asyncio.sleep(0.05)
        start_t = time.perf_counter()
        extra: dict[str, Any] = {}
        await asyncio.sleep(2.0)
        if amplifier is not None:
            sent = time.perf_counter()
            r = await client.post("/v1/completions", json={"model": model, **amplifier})
            extra = {"status": r.status_code, "latency_s": round(time.perf_counter() - sent, 2)}
            if r.status_code == 200:
                extra["choices"] = len(r.json()["choices"])
            else:
                extra["error"] = r.json()["error"]["message"][:160]
        end_t = max(start_t + args.window, time.perf_counter() + 2.0)
        await asyncio.sleep(max(0.0, end_t - time.perf_counter()))
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    gaps = [b - a for r in results for a, b in itertools.pairwise(r.token_times) if a >= start_t and b <= end_t]
    ms = [g * 1000 for g in gaps]
    return {"gaps": len(ms), "itl_p50_ms": round(percentile(ms, 50), 1), "itl_p99_ms": round(percentile(ms, 99), 1),
            "itl_max_ms": round(max(ms), 1) if ms else None, "window_s": round(end_t - start_t, 1), **extra}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=[*AMPLIFIERS, "none"],
                    help=f"of {list(AMPLIFIERS)}, in order (default: all, then none again: the reference's spread)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--window", type=float, default=20.0, help="seconds of ITL measured per run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flags", default="", help="extra fd serve flags, one string")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = set(args.cases) - set(AMPLIFIERS)
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}")
    out = Path(args.out or tempfile.mkdtemp(prefix=f"fd-amplification-{datetime.now():%Y%m%d-%H%M%S}-"))
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    fd = shutil.which("fd") or str(Path(sys.executable).with_name("fd"))
    cmd = [fd, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port), *args.flags.split()]
    print(f"== {' '.join(cmd)}", flush=True)
    proc = start(cmd, str(out / "server.log"))
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "machine": machine_info(), "command": cmd, "args": vars(args), "results": {}}
    try:
        if not wait_ready(proc, port, args.start_timeout):
            print(f"the server did not start; log tail:\n{(out / 'server.log').read_text()[-2000:]}")
            return 1
        # warm-up: one short request, so the first run does not pay for first-call costs
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=600,
                   json={"model": args.model, "prompt": "Hello", "max_tokens": 4})
        for case in args.cases:
            result = asyncio.run(run_case(port, args.model, AMPLIFIERS[case], args))
            label = case if case not in report["results"] else f"{case} (again)"
            report["results"][label] = result
            print(f"   {label}: {json.dumps(result)}", flush=True)
    finally:
        stop(proc)
    base = report["results"].get("none", {}).get("itl_p99_ms")
    print(f"\n{'run':<16} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'max ms':>9} {'p99 / none':>11}  amplifier")
    for case, r in report["results"].items():
        ratio = f"{r['itl_p99_ms'] / base:.2f}" if base else "-"
        what = (f"HTTP {r['status']} in {r['latency_s']} s" if "status" in r else "-")
        print(f"{case:<16} {r['itl_p50_ms']:>11} {r['itl_p99_ms']:>11} {r['itl_max_ms']:>9} {ratio:>11}  {what}")
    (out / "amplification.json").write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {out / 'amplification.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
