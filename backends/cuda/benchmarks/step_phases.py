"""Where a step's wall time goes: fd's engine functions wrapped in timers, on the model of
``e2e.py`` (bfloat16, CUDA graphs), for the batch-1 and the 128-request loads.

    python backends/cuda/benchmarks/step_phases.py [--no-async-scheduling] [--num-scheduler-steps K]

No synchronisation is added: GPU time shows up in whichever call waits for the GPU (reading a
step's tokens; with asynchronous scheduling that wait overlaps the next step, already queued).
Each load runs twice; the second is the one to read. ``--no-async-scheduling`` times the
synchronous engine; ``--num-scheduler-steps K`` rounds of K decode steps (figures stay per
device step). A decode step whose batch the graph draws (plain rows: plugin API 1.20) shows no
"sample (launch)": its draw is inside "graph replay".
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import sys  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.bench.phases import PhaseTimer  # noqa: E402
from fd_core.engine import core, executor, output_processor, scheduler  # noqa: E402
from fd_core.engine import model_runner as runner_module  # noqa: E402

timer = PhaseTimer()
spent = timer.spent


def instrument(llm: LLM) -> None:
    timer.wrap(core.EngineCore, "step", "engine core step (all of it)")
    timer.wrap(scheduler.Scheduler, "schedule", "schedule")
    timer.wrap(executor, "prepare_inputs", "prepare_inputs")
    timer.wrap(executor, "sampling_batch", "sampling_batch")
    timer.wrap(executor, "later_inputs", "a round's later inputs")
    from fd_backend_cuda import graphs

    timer.wrap(graphs._Graph, "replay_head", "graph replay (uploads + launch)")
    timer.wrap(runner_module.ModelRunner, "_forward", "forward (launch)")  # step and launch both call it
    timer.wrap(core.EngineCore, "_apply", "apply tokens")
    timer.wrap(output_processor.OutputProcessor, "process", "detokenize / outputs")
    from fd_backend_cuda.kernels import sampling

    ops = llm.engine.core.ops
    ops.sample = timer.timed("sample (waits for the GPU)", ops.sample)  # --no-async-scheduling
    ops.sample_async = timer.timed("sample (launch)", ops.sample_async)
    timer.wrap(sampling.DeviceSample, "result", "read tokens (waits for the GPU)")


def run(llm: LLM, title: str, prompts, params) -> None:
    for attempt in (1, 2):
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        spent.clear()
        steps0 = llm.engine.core.stats["steps"]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        steps = llm.engine.core.stats["steps"] - steps0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"--- {title}, run {attempt}: {wall * 1e3:.1f} ms, {steps} steps, {wall / steps * 1e3:.3f} ms/step, "
              f"{tokens / wall:.0f} output tokens/s")
        for label, seconds in spent.most_common():
            print(f"  {label:28s} {seconds / steps * 1e3:8.3f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--num-scheduler-steps", type=int, default=1, metavar="K")
    args = ap.parse_args()
    model = e2e.build_model(Path("/tmp/fd-ernie-0.3b"))
    llm = LLM(model=str(model), device="cuda", dtype="bfloat16", max_model_len=1300, max_num_seqs=128,
              async_scheduling=None if args.async_scheduling else False, num_scheduler_steps=args.num_scheduler_steps)
    instrument(llm)
    run(llm, "batch 1, 128-token prompt, 257 tokens", e2e.prompts(1, 128, 1),
        SamplingParams(temperature=0, max_tokens=257, ignore_eos=True))
    run(llm, "128 x 128-token prompts, 129 tokens (decodes, mostly)", e2e.prompts(128, 128, 1),
        SamplingParams(temperature=0, max_tokens=129, ignore_eos=True))
    run(llm, "128 x 1024-token prompts, 128 tokens", e2e.prompts(128, 1024, 2),
        SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    run(llm, "the same, top-k 50 / top-p 0.95 / T 0.8", e2e.prompts(128, 1024, 2),
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=128, ignore_eos=True, seed=3))


if __name__ == "__main__":
    main()
