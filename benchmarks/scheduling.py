#!/usr/bin/env python3
"""What prefix caching and chunked prefill buy, measured through `fd serve` (streamed completions).

    python benchmarks/scheduling.py [--model NAME] [--out DIR] [prefix] [stall]

prefix  A request with a PREFIX-token prompt prefix (random token ids) and a short suffix, then a
        second one with the same prefix and another suffix: TTFT of each and the second's
        usage.prompt_tokens_details.cached_tokens, with prefix caching on, then (for reference)
        off. A warm-up request with an unrelated prompt goes first, so neither pays for it.
stall   STREAMS streams decode (short prompts, long outputs); once every one has produced
        tokens, a LONG-token prompt arrives. Until its first token comes back, each stream's
        longest gap between two tokens is recorded; the streams are then cancelled. Servers:
        chunked prefill on with the backend's default budget, on with 2048 tokens per step,
        and off.

Each configuration gets a fresh server (so no cache carries over), started here and stopped
after. Figures print as a table and go to DIR/scheduling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from server_process import free_port, start, stop, wait_ready  # this folder's helper

from fd_core.bench.serve import RequestResult, machine_info, make_prompts, send_one

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
MODEL_NAME = MODEL  # what requests name; set from --model


def fd_serve(port: int, model: str, extra: list[str]) -> list[str]:
    fd = shutil.which("fd") or str(Path(sys.executable).with_name("fd"))
    return [fd, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port), *extra]


def body(prompt: list[int] | str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}


def token_ids(rng: np.random.Generator, n: int) -> list[int]:
    # ordinary vocabulary ids of SmolLM2 (its first ids are special and byte tokens)
    return rng.integers(1000, 40000, size=n).tolist()


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> RequestResult:
    result = await send_one(client, "/v1/completions", body(prompt, max_tokens), "completions", len(prompt))
    if not result.ok:
        raise RuntimeError(f"request failed: {result.error}")
    return result


async def prefix_case(port: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    prefix = token_ids(rng, args.prefix)
    first, second = prefix + token_ids(rng, args.suffix), prefix + token_ids(rng, args.suffix)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        await one(client, token_ids(rng, 64), 4)  # warm-up
        a = await one(client, first, args.output)
        b = await one(client, second, args.output)
    return {"prompt_tokens": [a.prompt_tokens, b.prompt_tokens],
            "cached_tokens": [a.cached_tokens, b.cached_tokens],
            "ttft_s": [round(a.ttft, 3), round(b.ttft, 3)],
            "ttft_ratio": round(a.ttft / b.ttft, 2),
            "cached_fraction_second": round((b.cached_tokens or 0) / b.prompt_tokens, 3)}


async def stall_case(port: int, args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=1200) as client:
        await one(client, token_ids(rng, 64), 4)  # warm-up
        results = [RequestResult() for _ in range(args.streams)]
        # Every token must arrive as a chunk with text, or a gap would look longer than it was:
        # English prompts (no token ending mid-character) and special tokens kept as text (past
        # its answer, with ignore_eos, the model emits chat-template tokens that are otherwise
        # skipped).
        streams = [asyncio.create_task(send_one(client, "/v1/completions",
                                                {**body(prompt, 4000), "skip_special_tokens": False},
                                                "completions", 32, r))
                   for prompt, r in zip(make_prompts(args.streams, 24, args.seed), results)]
        while any(len(r.token_times) < 3 for r in results):  # every stream is decoding
            await asyncio.sleep(0.05)
        sent = time.perf_counter()
        long = await one(client, token_ids(rng, args.long), 1)
        first_token = long.token_times[0]
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)

    gaps, before = [], []
    for r in results:
        times = r.token_times
        # the gap spanning the long prompt's arrival counts too
        during = [b - a for a, b in itertools.pairwise(times) if b > sent and a < first_token]
        gaps.append(max(during) if during else first_token - sent)
        before += [b - a for a, b in itertools.pairwise(times) if b <= sent]
    return {"long_prompt_tokens": long.prompt_tokens, "long_ttft_s": round(long.ttft, 2),
            "max_gap_s": round(max(gaps), 2), "median_stream_max_gap_s": round(statistics.median(gaps), 2),
            "itl_before_s": round(statistics.median(before), 3) if before else None}


CASES = {
    "prefix": [("prefix caching on", []), ("prefix caching off", ["--no-enable-prefix-caching"])],
    "stall": [("chunked, backend budget", []), ("chunked, 2048/step", ["--max-num-batched-tokens", "2048"]),
              ("chunked prefill off", ["--no-enable-chunked-prefill"])],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", default=list(CASES), help="prefix, stall (default: both)")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--prefix", type=int, default=1000, help="shared prefix, tokens")
    ap.add_argument("--suffix", type=int, default=24, help="each request's own tail, tokens")
    ap.add_argument("--output", type=int, default=8, help="tokens generated by the prefix requests")
    ap.add_argument("--long", type=int, default=4000, help="the long prompt of the stall case, tokens")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = set(args.cases) - set(CASES)
    if unknown:
        ap.error(f"unknown case(s) {sorted(unknown)}; choose from {list(CASES)}")

    global MODEL_NAME
    MODEL_NAME = args.model
    out = Path(args.out or tempfile.mkdtemp(prefix=f"fd-scheduling-{datetime.now():%Y%m%d-%H%M%S}-"))
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "machine": machine_info(), "args": vars(args), "results": {}}
    for case in args.cases:
        for label, flags in CASES[case]:
            port = free_port()
            cmd = fd_serve(port, args.model, flags)
            log = out / f"{case}-{len(report['results'])}.log"
            print(f"== {case} / {label}: {' '.join(cmd)}", flush=True)
            proc = start(cmd, str(log))
            try:
                if not wait_ready(proc, port, args.start_timeout):
                    print(f"   the server did not start; log tail:\n{log.read_text()[-2000:]}", flush=True)
                    return 1
                run = prefix_case if case == "prefix" else stall_case
                result = asyncio.run(run(port, args))
            finally:
                stop(proc)
            print("   " + json.dumps(result), flush=True)
            report["results"][f"{case}: {label}"] = {"flags": flags, **result}
    (out / "scheduling.json").write_text(json.dumps(report, indent=2))
    print(f"\nwritten: {out / 'scheduling.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
