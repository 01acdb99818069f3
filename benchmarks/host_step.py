#!/usr/bin/env python3
"""The engine's own per-step host work at many sequences, without an accelerator: the
backend-independent phases of a decode step (schedule, the step's inputs, the sampling batch,
applying the sampled tokens, building the outputs), timed on the CPU backend with a model so
small that its forward is noise beside them.

    python benchmarks/host_step.py [--seqs 128] [--tokens 256] [--repeats 3]

On a GPU host these phases run on the same Python thread that launches the step, so at 128
sequences they bound the decode rate wherever they exceed the GPU's step (docs/PERFORMANCE.md,
the cuda sections). Each phase prints µs a decode step (the median of ``--repeats`` runs).
The scheduler runs with the GPU backends' budget policy (no long-prefill cap), not the CPU's.
Without a tokenizer (``skip_tokenizer_init``): a random model's tokens are random bytes, which
the detokenizer must take one by one, a cost real text does not have.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.bench.phases import PhaseTimer  # noqa: E402
from fd_core.engine import core, executor, output_processor, scheduler  # noqa: E402
from tests import checkpoints  # noqa: E402

PHASES = {
    "schedule": (scheduler.Scheduler, "schedule"),
    "prepare_inputs": (executor, "prepare_inputs"),
    "sampling_batch": (executor, "sampling_batch"),
    "apply tokens": (core.EngineCore, "_apply"),
    "outputs": (output_processor.OutputProcessor, "process"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256, help="decode steps a run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-scheduler-steps", type=int, default=1, metavar="K",
                    help="rounds of K decode steps (asynchronous scheduling with the tests' host-fed sample_async)")
    args = ap.parse_args()
    rounds = {}
    if args.num_scheduler_steps > 1:  # rounds need a sample_async; the CPU backend's tests have one
        import pytest
        from tests.plugins.host_fed import async_cpu_registry

        async_cpu_registry(pytest.MonkeyPatch(), "torch")
        rounds = {"num_scheduler_steps": args.num_scheduler_steps}
    timer = PhaseTimer()
    for label, (owner, name) in PHASES.items():
        timer.wrap(owner, name, label)
    with tempfile.TemporaryDirectory() as tmp:
        model = checkpoints.make_llama(Path(tmp), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=args.tokens + 64)
        llm = LLM(model=str(model), device="cpu", runtime="torch", max_num_seqs=args.seqs,
                  max_model_len=args.tokens + 64, max_num_batched_tokens=8192, skip_tokenizer_init=True,
                  num_kv_blocks=args.seqs * ((args.tokens + 64) // 8 + 2),
                  # the GPU backends' budget policy: no long-prefill cap, so schedule() hands no
                  # leftover budget back (the CPU backend's default of 24 made it do so every step)
                  long_prefill_token_threshold=0, **rounds)
        prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(16)]} for i in range(args.seqs)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        runs: dict[str, list[float]] = collections.defaultdict(list)
        for r in range(args.repeats + 1):
            llm.reset_prefix_cache()
            timer.spent.clear()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            if r == 0:
                continue  # warm-up
            for label in PHASES:
                runs[label].append(timer.spent[label] / args.tokens * 1e6)  # ~one step a token
            runs["whole step (forward included)"].append(wall / args.tokens * 1e6)
    print(f"{args.seqs} sequences decoding (16-token prompts, one step), {args.tokens} tokens each, "
          f"--num-scheduler-steps {args.num_scheduler_steps}, median of {args.repeats} runs, per decode step:")
    for label, values in runs.items():
        print(f"  {label:32s} {statistics.median(values):8.1f} µs a step")


if __name__ == "__main__":
    main()
