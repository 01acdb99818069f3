"""Mixture-of-experts models on the cuda backend, CUDA graphs on: the tiny random Qwen3-MoE and
ERNIE 4.5 MoE checkpoints give the CPU's greedy tokens in float32 (the cuda backend has no
fused MoE kernel yet: the torch reference ``moe`` runs, in its graph-safe form inside captured
decode steps)."""

from __future__ import annotations

import numpy as np
import pytest

from tests import checkpoints

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

from fd_core import LLM, SamplingParams


@pytest.mark.parametrize("make", [checkpoints.make_qwen3_moe, checkpoints.make_ernie45_moe], ids=["qwen3-moe", "ernie45-moe"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_greedy_tokens_equal_the_cpu(tmp_path, make, eager):
    model = make(tmp_path)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 500, size=int(rng.integers(4, 30))).tolist() for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(model=str(model), device="cpu", runtime="torch", block_size=4, num_kv_blocks=512, max_model_len=128)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    gpu = LLM(model=str(model), device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=512,
              enforce_eager=eager)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)] == want
