"""Offline generation speed on one device: decode tokens/s at batch 1, and output tokens/s for
N concurrent prompts. Prints figures; asserts nothing about them.

    python benchmarks/offline_throughput.py [--model M] [--device cpu] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from fd_core import LLM, SamplingParams
from fd_core.loader import DEFAULT_MODEL


def prompts(n: int) -> list[str]:
    topics = ["the ocean", "mountains", "a city at night", "a robot", "tea", "winter", "a library",
              "the moon", "bicycles", "volcanoes", "a market", "trains", "music", "rain", "chess", "bread"]
    return [f"Write a short story about {topics[i % len(topics)]}." for i in range(n)]


def timed(llm: LLM, batch: list[str], params: SamplingParams) -> tuple[float, int, float]:
    """(seconds, output tokens, seconds to the first sampled token of a single prompt)"""
    engine = llm.engine
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"bench-{time.time_ns()}-{i}", p, params)
    first = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                tokens += sum(len(o.token_ids) for o in out.outputs)
    return time.perf_counter() - start, tokens, first or 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runtime", default=None, help="paddle or torch (default: the device's own)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    llm = LLM(model=args.model, device=args.device, runtime=args.runtime, max_model_len=2048,
              max_num_seqs=max(16, args.concurrency))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    timed(llm, prompts(1), SamplingParams(temperature=0, max_tokens=4))  # warm-up

    secs, toks, ttft = timed(llm, prompts(1), params)
    decode_tps = (toks - 1) / (secs - ttft)
    secs_n, toks_n, _ = timed(llm, prompts(args.concurrency), params)
    result = {
        "model": args.model,
        "device": args.device,
        "runtime": llm.engine.core.platform.runtime,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "batch1_decode_tokens_per_s": round(decode_tps, 2),
        "batch1_time_per_output_token_ms": round(1000 / decode_tps, 2),
        "batch1_ttft_s": round(ttft, 3),
        "concurrency": args.concurrency,
        "concurrent_output_tokens_per_s": round(toks_n / secs_n, 2),
        "concurrent_wall_s": round(secs_n, 2),
        "output_len": args.output_len,
    }
    for key, value in result.items():
        print(f"{key:34} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
