"""GPU kernel time of ``e2e.py``'s loads, by kernel, from ``torch.profiler``.

    python backends/cuda/benchmarks/gpu_profile.py [--load throughput|batch1|mixed] [--batch N] [--trace FILE]
        [--model FOLDER] [--num-scheduler-steps K]

``throughput`` (the default): 128 × 1024-token prompts, bfloat16, once for the prefill alone
(``max_tokens=1``) and once for the whole load (128 tokens), so decode's share is the
difference: each load's unprofiled wall time, the GPU's busy time (profiled) and the kernels by
exclusive time. The sum of kernel times is the floor the host's work per step is measured against.

The host's operations in a profiled run are CUPTI's view: ``cudaGraphLaunch`` there costs ~2 µs
a node of the graph, against 3-6 µs for the whole launch unprofiled (``launch_cost.py``).

``batch1``: one 128-token prompt decoding 128 tokens as ``e2e.py`` times it (CUDA graphs,
asynchronous scheduling); ``--batch N``: N such prompts decoding together. Unprofiled, CUDA
events around every graph replay give the GPU's own time inside the step graphs and between
them: the idle a decode step, apart from what the loop does after its last step (decoding the
text of every sequence, which its wall time a step includes). Host and GPU are both
recorded; it prints, per decode step, the wall time, the time the GPU was busy (the union of its
kernels' intervals), the kernels launched, the host's operations by their own time, and a
cProfile of the steps' Python, so a step's idle GPU time is split between what the host did and
what the GPU did. ``--trace`` writes the timeline (Chrome's trace format).

``mixed``: 64 sequences decoding while new 256-token prompts arrive (2, then 8, each round), so
the engine runs mixed prefill+decode steps between decode steps: the wall time of the steps
that admit prompts against the others, the GPU's busy time and the kernels over the rounds,
the host's operations by their own time, and a cProfile of the mixed steps' Python (``--trace``
writes the timeline here too).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from fd_core import LLM, SamplingParams  # noqa: E402


def kernel_spans(events) -> list[tuple[str, float, float]]:
    """``(name, start, end)`` of every kernel among a profile's events (µs)."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]


def busy_us(spans: list[tuple[str, float, float]]) -> tuple[float, int]:
    """The union of the kernels' intervals (µs) and their count."""
    by_name = exclusive_us(spans).values()
    return sum(t for t, _ in by_name), sum(n for _, n in by_name)


def exclusive_us(spans: list[tuple[str, float, float]]) -> dict[str, tuple[float, int]]:
    """Per kernel name, the GPU time it alone accounts for and its launches, from ``(name,
    start, end)`` spans: time covered by several kernels goes to the one that started first.
    Under programmatic dependent launch a kernel starts while the one ahead still runs and
    waits for it, so its own duration counts that wait twice; here the wait is the kernel
    ahead's, and the names' times add up to the union ``busy_us`` reports."""
    out: dict[str, list] = {}
    frontier = float("-inf")
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[2])):
        entry = out.setdefault(name, [0.0, 0])
        entry[0] += max(0.0, end - max(start, frontier))
        entry[1] += 1
        frontier = max(frontier, end)
    return {name: (t, n) for name, (t, n) in out.items()}


def print_exclusive(spans: list[tuple[str, float, float]], steps: int) -> None:
    table = sorted(exclusive_us(spans).items(), key=lambda kv: -kv[1][0])
    print("---- GPU time by kernel, overlaps given to the kernel that started first (a wait under "
          "programmatic launch is the kernel ahead's time), µs a step / launches a step / µs a launch")
    for name, (t, n) in table[:20]:
        print(f"  {t / steps:9.1f} {n / steps:7.1f} {t / n:8.2f}  {name[:90]}")


@contextlib.contextmanager
def replay_marks():
    """Every CUDA graph replay in the block, bracketed by CUDA events (unprofiled: events cost
    the GPU nothing measurable): yields a list that fills with ``(before, after, host time of
    the call)``."""
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event, float]] = []
    replay = torch.cuda.CUDAGraph.replay

    def marked(graph: torch.cuda.CUDAGraph) -> None:
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        replay(graph)
        after.record()
        marks.append((before, after, time.perf_counter()))

    torch.cuda.CUDAGraph.replay = marked
    try:
        yield marks
    finally:
        torch.cuda.CUDAGraph.replay = replay


def between_steps(inside_us: list[float], between_us: list[float]) -> str:
    """A line on a run of graph replays: the GPU's time inside each graph, between one graph's
    end and the next one's start (the draw's copy, the feed or advance, the launch, and any wait
    for the host), and that waiting's share of the steps."""
    inside, between = np.asarray(inside_us), np.asarray(between_us)
    idle = between.sum() / (inside.sum() + between.sum())
    return (f"GPU in a graph p50 {np.median(inside):.0f} µs, between graphs p50 {np.median(between):.0f} / mean "
            f"{between.mean():.0f} / p90 {np.percentile(between, 90):.0f} µs: idle {idle:.0%} of the decode steps")


def throughput(llm: LLM) -> None:
    many = e2e.prompts(128, 1024, 2)
    for label, tokens in (("prefill only (max_tokens=1)", 1), ("whole load (128 tokens)", 128)):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(many, params, use_tqdm=False)  # untimed: compile, capture, allocate
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(many, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
        llm.reset_prefix_cache()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(many, params, use_tqdm=False)
        llm.reset_prefix_cache()
        spans = kernel_spans(prof.events())
        busy, kernels = busy_us(spans)
        print(f"==== {label}: {wall:.1f} ms unprofiled, GPU busy {busy / 1e3:.1f} ms (profiled), {kernels} kernels")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        print_exclusive(spans, 1)


def host_speed() -> str:
    """Where this thread runs and how fast its CPU runs plain Python now: the CPU it is on, that
    CPU's clock as /proc/cpuinfo reports it, and the best of five timings of a fixed loop. A
    decode step's host time has been seen to differ ~1.4x between processes of the same code on
    one machine type; this tells a slower CPU from anything else."""
    with open("/proc/thread-self/stat") as f:
        cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    mhz = "?"
    with open("/proc/cpuinfo") as f:
        for block in f.read().split("\n\n"):
            fields = {k.strip(): v for k, v in (line.split(":", 1) for line in block.splitlines() if ":" in line)}
            if fields.get("processor", "").strip() == str(cpu):
                mhz = fields.get("cpu MHz", "?").strip()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        sum(i * i for i in range(100_000))
        best = min(best, time.perf_counter() - start)
    return f"thread on CPU {cpu} at {mhz} MHz, a fixed Python loop {best * 1e3:.2f} ms"


def batch1(llm: LLM, trace: Path | None, batch: int = 1) -> None:
    engine = llm.engine
    prompts = e2e.prompts(batch, 128, 1)
    params = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # untimed: graphs, kernels
    for attempt, activities in enumerate((None, "python", [ProfilerActivity.CPU, ProfilerActivity.CUDA])):
        llm.reset_prefix_cache()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"b1-{attempt}-{i}", prompt, params)
        engine.step()  # the prefill, outside the figures
        python = cProfile.Profile() if activities == "python" else None
        # (an empty activity list is not "no profiling": torch then records its defaults)
        with (profile(activities=activities) if isinstance(activities, list) else python
              or replay_marks()) as prof:
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step(final_only=True)  # as LLM.generate: text decoded once, at the end
            end = time.perf_counter()
            wall = (end - start) * 1e6
        steps = params.max_tokens - 1  # the decode steps: the prefill made each sequence's first token
        if activities is None:
            torch.cuda.synchronize()
            inside = [a.elapsed_time(b) * 1e3 for a, b, _ in prof]
            between = [prof[i][1].elapsed_time(prof[i + 1][0]) * 1e3 for i in range(len(prof) - 1)]
            print(f"==== batch {batch}, unprofiled: {wall / steps:.1f} µs per decode step over {steps} steps "
                  f"({host_speed()})")
            # the loop's wall also holds what follows the last step (the text decoded at the end),
            # which is no decode step's idle time: the GPU's own view of the steps, from events
            print(f"==== batch {batch}, between decode steps (CUDA events around {len(prof)} replays): "
                  f"{between_steps(inside, between)}; after the last replay the loop ran "
                  f"{(end - prof[-1][2]) * 1e3:.1f} ms more (decoding the text)")
            continue
        if python is not None:
            print(f"---- cProfile of the {steps} decode steps' Python (by own time; {wall / steps:.0f} µs a step "
                  "with cProfile's overhead)")
            pstats.Stats(python).sort_stats("tottime").print_stats(30)
            pstats.Stats(python).sort_stats("cumulative").print_stats(45)  # which calls hold the time
            continue
        spans = kernel_spans(prof.events())
        busy, kernels = busy_us(spans)
        print(f"==== batch {batch}, profiled: {steps} decode steps, {wall / steps:.1f} µs wall a step, GPU busy "
              f"{busy / steps:.1f} µs a step ({busy / wall:.0%}), {kernels / steps:.1f} kernels a step")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        print_exclusive(spans, steps)
        if trace:
            prof.export_chrome_trace(str(trace))


def mixed(llm: LLM, trace: Path | None) -> None:
    engine = llm.engine
    core = engine.core
    running = e2e.prompts(64, 256, 3)
    arriving = e2e.prompts(400, 256, 4)
    decode = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def rounds(count: int, per_round: int, tag: str, profiler=None, prof=None) -> dict[str, list[float]]:
        walls: dict[str, list[float]] = {"mixed": [], "decode": []}
        for i, prompt in enumerate(running):
            engine.add_request(f"{tag}-run-{i}", prompt, decode)
        while core.scheduler.waiting:
            engine.step()
        for r in range(count):
            for j in range(per_round):
                engine.add_request(f"{tag}-{r}-{j}", arriving[(r * per_round + j) % len(arriving)], short)
            for _ in range(4):
                kind = "mixed" if core.scheduler.waiting else "decode"
                if kind == "mixed" and profiler is not None:
                    profiler.enable()
                start = time.perf_counter()
                engine.step()
                walls[kind].append((time.perf_counter() - start) * 1e3)
                if kind == "mixed" and profiler is not None:
                    profiler.disable()
                if prof is not None:
                    prof.step()
        for i in range(len(running)):
            engine.abort_request(f"{tag}-run-{i}")
        while engine.has_unfinished_requests():
            engine.step()
        llm.reset_prefix_cache()
        return walls

    for per_round in (2, 8):
        rounds(3, per_round, f"warm{per_round}")  # untimed: compile, capture
        walls = rounds(20, per_round, f"t{per_round}")
        profiler = cProfile.Profile()
        rounds(20, per_round, f"p{per_round}", profiler=profiler)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            rounds(10, per_round, f"g{per_round}")
        busy, kernels = busy_us(kernel_spans(prof.events()))
        m, d = sorted(walls["mixed"]), sorted(walls["decode"])
        print(f"==== 64 decoding, {per_round} x 256-token prompts arriving a round: {len(m)} mixed steps, "
              f"wall median {m[len(m) // 2]:.2f} ms, max {m[-1]:.2f} ms; {len(d)} other steps, median "
              f"{d[len(d) // 2]:.2f} ms; profiled rounds: GPU busy {busy / 1e3:.1f} ms, {kernels} kernels")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
        stats = pstats.Stats(profiler)
        print(f"---- cProfile of the {len(m)} mixed steps' Python (by own time)")
        stats.sort_stats("tottime").print_stats(30)
        if trace:
            prof.export_chrome_trace(str(trace.with_suffix(f".mixed{per_round}.json")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--load", choices=("throughput", "batch1", "mixed"), default="throughput")
    ap.add_argument("--batch", type=int, default=1, help="batch1: this many prompts decoding together")
    ap.add_argument("--trace", type=Path, default=None, help="batch1, mixed: write the timeline here")
    ap.add_argument("--model", type=Path, default=None,
                    help="a checkpoint folder (e.g. quantized.py's Llama-3-8B shape); default: the ERNIE-4.5-0.3B shape")
    ap.add_argument("--quantization", default=None, help="the engine's flag (e.g. wint4 with quantized.py's checkpoint)")
    ap.add_argument("--num-scheduler-steps", type=int, default=1, metavar="K",
                    help="rounds of K decode steps (the engine's flag); the figures stay per device step")
    args = ap.parse_args()
    model = args.model or e2e.build_model(Path("/tmp/fd-ernie-0.3b"))
    llm = LLM(model=str(model), device="cuda", dtype="bfloat16",
              max_model_len=1300, max_num_seqs=128, num_scheduler_steps=args.num_scheduler_steps,
              quantization=args.quantization)
    if args.load == "batch1":
        batch1(llm, args.trace, args.batch)
    elif args.load == "mixed":
        mixed(llm, args.trace)
    else:
        throughput(llm)


if __name__ == "__main__":
    main()
