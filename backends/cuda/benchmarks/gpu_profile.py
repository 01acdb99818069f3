"""GPU kernel time of ``e2e.py``'s throughput load (128 × 1024-token prompts, 128 output tokens,
bfloat16), by kernel, from ``torch.profiler``: once for the prefill alone (``max_tokens=1``),
once for the whole load, so decode's share is the difference.

    python backends/cuda/benchmarks/gpu_profile.py

The sum of kernel times is the floor the host's work per step is measured against.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402
from fd_core import LLM, SamplingParams  # noqa: E402


def main() -> None:
    llm = LLM(model=str(e2e.build_model(Path("/tmp/fd-ernie-0.3b"))), device="cuda", dtype="bfloat16",
              max_model_len=1300, max_num_seqs=128)
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


if __name__ == "__main__":
    main()
