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


def _greedy(model, tp: int, expert_parallel: bool, prompts: list[list[int]]) -> list[list[int]]:
    import gc

    llm = LLM(model=str(model), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
              tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, gpu_memory_utilization=0.3)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    finally:
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices")


@two_gpus
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-sliced", "expert-parallel"])
def test_two_gpus_give_the_greedy_output_of_one(tmp_path, expert_parallel):
    """NCCL, CUDA graphs on, float32: the ERNIE-4.5-21B-A3B shape at two layers (one sparse: 64
    experts, top-6, two shared experts) and the tiny ERNIE MoE, on two GPUs with each expert
    sliced or the experts dealt out (32 a GPU), give one GPU's greedy tokens."""
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    shape = dict(checkpoints.ERNIE_45_21B_A3B, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    large = checkpoints.make_large_random(tmp_path, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, "ernie45_21b", **shape)
    tiny = checkpoints.make_ernie45_moe(tmp_path)
    rng = np.random.default_rng(3)
    for model, vocab in ((tiny, 500), (large, shape["vocab_size"])):
        prompts = [rng.integers(3, vocab, size=int(rng.integers(8, 120))).tolist() for _ in range(8)]
        assert _greedy(model, 2, expert_parallel, prompts) == _greedy(model, 1, False, prompts)
