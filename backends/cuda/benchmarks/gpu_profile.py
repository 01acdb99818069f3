"""GPU kernel time of ``e2e.py``'s loads, by kernel, from ``torch.profiler``.

    python backends/cuda/benchmarks/gpu_profile.py [--load throughput|batch1] [--trace FILE]

``throughput`` (the default): 128 × 1024-token prompts, bfloat16, once for the prefill alone
(``max_tokens=1``) and once for the whole load (128 tokens), so decode's share is the
difference. The sum of kernel times is the floor the host's work per step is measured against.

``batch1``: one 128-token prompt decoding 128 tokens as ``e2e.py`` times it (CUDA graphs,
asynchronous scheduling). Host and GPU are both recorded; it prints, per decode step, the wall
time, the time the GPU was busy (the union of its kernels' intervals), the kernels launched,
and the host's operations by their own time, so a step's idle GPU time is split between what
the host did and what the GPU did. ``--trace`` writes the timeline (Chrome's trace format).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from fd_core import LLM, SamplingParams  # noqa: E402


def busy_us(events) -> tuple[float, int]:
    """The union of the kernels' intervals (µs) and their count."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA)
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total, len(spans)


def throughput(llm: LLM) -> None:
    many = e2e.prompts(128, 1024, 2)
    for label, tokens in (("prefill only (max_tokens=1)", 1), ("whole load (128 tokens)", 128)):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(many, params, use_tqdm=False)  # untimed: compile, capture, allocate
        llm.reset_prefix_cache()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(many, params, use_tqdm=False)
        llm.reset_prefix_cache()
        print(f"==== {label}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


def batch1(llm: LLM, trace: Path | None) -> None:
    engine = llm.engine
    prompt = e2e.prompts(1, 128, 1)[0]
    params = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # untimed: graphs, kernels
    for attempt, activities in enumerate((None, [ProfilerActivity.CPU, ProfilerActivity.CUDA])):
        llm.reset_prefix_cache()
        engine.add_request(f"b1-{attempt}", prompt, params)
        engine.step()  # the prefill, outside the figures
        # (an empty activity list is not "no profiling": torch then records its defaults)
        with profile(activities=activities) if activities else contextlib.nullcontext() as prof:
            start, steps = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                steps += bool(engine.step())
            wall = (time.perf_counter() - start) * 1e6
        if not activities:
            print(f"==== batch 1, unprofiled: {wall / steps:.1f} µs per decode step over {steps} steps")
            continue
        events = prof.events()
        busy, kernels = busy_us(events)
        print(f"==== batch 1, profiled: {steps} decode steps, {wall / steps:.1f} µs wall a step, GPU busy "
              f"{busy / steps:.1f} µs a step ({busy / wall:.0%}), {kernels / steps:.1f} kernels a step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        if trace:
            prof.export_chrome_trace(str(trace))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", choices=("throughput", "batch1"), default="throughput")
    ap.add_argument("--trace", type=Path, default=None, help="batch1: write the timeline here")
    args = ap.parse_args()
    llm = LLM(model=str(e2e.build_model(Path("/tmp/fd-ernie-0.3b"))), device="cuda", dtype="bfloat16",
              max_model_len=1300, max_num_seqs=128)
    if args.load == "batch1":
        batch1(llm, args.trace)
    else:
        throughput(llm)


if __name__ == "__main__":
    main()
