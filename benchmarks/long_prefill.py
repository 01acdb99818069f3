#!/usr/bin/env python3
"""A short request behind a long prompt: what ``--long-prefill-token-threshold`` buys.

    python benchmarks/long_prefill.py [--model NAME] [--thresholds 0,64,128] [--json FILE] [real] [steps]

real   In-process engine (``LLMEngine``, the CPU backend's defaults otherwise): a LONG-token
       prompt is submitted, then a SHORT-token prompt DELAY seconds later (the engine takes it
       at the end of the step it is computing, as ``fd serve``'s engine core would). For each
       threshold: the short request's time to first token (from its arrival), the long one's
       time to first token (its whole prefill), and the long prompt alone for reference. Greedy,
       one output token each, random token ids; a warm-up request goes first.
steps  The scheduler alone, with no model (a step's time on the CPU is about proportional to
       its tokens): with K long prompts already prefilling, how many steps a short request
       waits for its first token, and how many steps the long prompts take to finish, for each
       threshold and K. Shows what the threshold's value decides: how many long prompts may
       prefill at once before admission waits again.

Prints a table per part; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from fd_core.bench.serve import machine_info
from fd_core.engine.block_pool import BlockPool
from fd_core.engine.sampling_params import SamplingParams
from fd_core.engine.scheduler import Scheduler
from fd_core.engine.sequence import Sequence, Status
from fd_core.loader import DEFAULT_MODEL


def token_ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1000, 40000, size=n).tolist()  # ordinary vocabulary ids of SmolLM2


def real_case(engine, args: argparse.Namespace, threshold: int, with_short: bool) -> dict[str, Any]:
    engine.core.scheduler.long_prefill_token_threshold = threshold
    engine.pool.reset_prefix_cache()  # the same prompts in every case: nothing may come from the cache
    rng = np.random.default_rng(args.seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    long, short = token_ids(rng, args.long), token_ids(rng, args.short)
    tag = f"{threshold}-{time.time_ns()}"
    steps_before = engine.stats["steps"]
    start = time.perf_counter()
    engine.add_request(f"long-{tag}", long, params)
    done: dict[str, float] = {}
    short_sent = None
    while engine.has_unfinished_requests() or (with_short and short_sent is None):
        now = time.perf_counter()
        if with_short and short_sent is None and now - start >= args.delay:
            short_sent = start + args.delay  # it arrived then; the engine takes it between steps
            engine.add_request(f"short-{tag}", short, params)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + args.delay - now))
            continue
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in done:
                done[out.request_id] = time.perf_counter()
    result = {"threshold": threshold, "long_ttft_s": round(done[f"long-{tag}"] - start, 2),
              "steps": engine.stats["steps"] - steps_before}
    if with_short:
        result["short_ttft_s"] = round(done[f"short-{tag}"] - short_sent, 2)
    return result


def real(args: argparse.Namespace) -> list[dict[str, Any]]:
    from fd_core.engine.config import EngineConfig
    from fd_core.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=args.model, device="cpu", max_model_len=args.long + args.short + 64))
    config = engine.config
    print(f"budget {config.max_num_batched_tokens} tokens/step; default threshold {config.long_prefill_token_threshold}")
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("warm-up", token_ids(np.random.default_rng(99), 64), warm)
    engine.run()
    rows = []
    for threshold in args.thresholds:
        for with_short in (True, False):
            row = {**real_case(engine, args, threshold, with_short), "short": with_short}
            print("   " + json.dumps(row), flush=True)
            rows.append(row)
    return rows


def steps_case(threshold: int, num_long: int, long_len: int, short_len: int, budget: int) -> dict[str, Any]:
    pool = BlockPool(num_blocks=(num_long * long_len + short_len) // 16 + 64, block_size=16)
    sched = Scheduler(pool, max_num_seqs=64, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    seqs = [Sequence(seq_id=i, request_id=str(i), index=0, prompt_token_ids=[1] * long_len,
                     params=SamplingParams(max_tokens=1), seed=i, arrival=i, max_tokens=1)
            for i in range(num_long)]
    short = Sequence(seq_id=num_long, request_id="short", index=0, prompt_token_ids=[2] * short_len,
                     params=SamplingParams(max_tokens=1), seed=0, arrival=num_long, max_tokens=1)
    for seq in seqs:
        sched.add(seq)
    first: dict[int, int] = {}
    step = 0
    while sched.has_work() or step <= num_long:
        if step == num_long:  # the long ones have each had a step to start
            sched.add(short)
        step += 1
        out = sched.schedule()
        sampled = [s.seq for s in out.scheduled if s.samples]
        sched.advance(out)
        for seq in sampled:
            first[seq.seq_id] = step
            seq.output_token_ids.append(0)
            seq.status = Status.FINISHED
            sched.finish(seq)
    longs = [first[s.seq_id] for s in seqs]
    return {"threshold": threshold, "long_prompts": num_long, "short_waits_steps": first[short.seq_id] - num_long,
            "long_done_steps": longs}


def steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for short_len in (args.short, 300):
        for num_long in (1, 2, 3, 4):
            for threshold in args.thresholds:
                row = steps_case(threshold, num_long, args.long, short_len, args.budget)
                row["short"] = short_len
                print("   " + json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", default=["real", "steps"])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--thresholds", default="0,64,128", help="comma-separated; 0: no cap")
    ap.add_argument("--long", type=int, default=4486, help="the long prompt, tokens")
    ap.add_argument("--short", type=int, default=10, help="the short prompt, tokens")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds between the two submissions")
    ap.add_argument("--budget", type=int, default=256, help="tokens per step, for the steps part")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.thresholds = [int(t) for t in args.thresholds.split(",")]
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "machine": machine_info(), "args": vars(args)}
    for part in args.parts:
        print(f"== {part}", flush=True)
        report[part] = {"real": real, "steps": steps}[part](args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
