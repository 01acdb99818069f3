"""Mixture-of-experts models on the cuda backend (the fused MoE kernel, CUDA graphs on): the tiny
random Qwen3-MoE and ERNIE 4.5 MoE checkpoints give the CPU's greedy tokens in float32; an
ERNIE-4.5-21B-A3B-shaped random model at reduced depth gives transformers' greedy tokens in
float32, plain and with every decoder linear in wint4, and its bfloat16 logits are no further
from transformers' float32 ones than transformers' own bfloat16 forward's (times 1.5, as
``test_ernie.py``); two and four GPUs give one GPU's tokens."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from tests.oracle import teacher_forced_ties

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


def _on_gpu(model, use, **kw):
    """``use(llm)`` with an LLM on the GPU; afterwards the engine is shut down and its memory goes
    back to the device, so the next engine (or transformers, or a worker process of a
    tensor-parallel one, which counts this process's cached blocks as in use) gets the GPU. No
    caller holds the LLM: a name bound by ``with ... as llm`` would keep it alive past the
    clean-up."""
    llm = LLM(model=str(model), device="cuda", max_num_seqs=8, **kw)
    try:
        return use(llm)
    finally:
        llm.engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _greedy(model, prompts: list[list[int]], steps: int = 32, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    outs = _on_gpu(model, lambda llm: llm.generate(prompts, params, use_tqdm=False), **kw)
    return [o.outputs[0].token_ids for o in outs]


def _gpus(count: int):
    return pytest.mark.skipif(torch.cuda.device_count() < count, reason=f"needs {count} CUDA devices")


PARALLEL = {"dtype": "float32", "max_model_len": 256, "gpu_memory_utilization": 0.3}


@pytest.fixture(scope="module")
def parallel_models(tmp_path_factory):
    """``{name: (folder, prompts, one GPU's greedy tokens)}`` for the tiny ERNIE MoE and the
    ERNIE-4.5-21B-A3B shape at two layers (one sparse: 64 experts, top-6, two shared experts),
    float32, computed once for every world size."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    tmp = tmp_path_factory.mktemp("parallel")
    shape = dict(checkpoints.ERNIE_45_21B_A3B, num_hidden_layers=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    large = checkpoints.make_large_random(tmp, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, "ernie45_21b", **shape)
    tiny = checkpoints.make_ernie45_moe(tmp)
    rng = np.random.default_rng(3)
    models = {}
    for name, model, vocab in (("tiny", tiny, 500), ("21b", large, shape["vocab_size"])):
        prompts = [rng.integers(3, vocab, size=int(rng.integers(8, 120))).tolist() for _ in range(8)]
        models[name] = (model, prompts, _greedy(model, prompts, **PARALLEL))
    return models


@pytest.mark.parametrize("world", [pytest.param(2, marks=_gpus(2)), pytest.param(4, marks=_gpus(4))])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["experts-sliced", "expert-parallel"])
def test_several_gpus_give_the_greedy_output_of_one(parallel_models, world, expert_parallel):
    """NCCL, CUDA graphs on, float32, scheduled synchronously: the models of ``parallel_models``
    on ``world`` GPUs, each expert sliced or the experts dealt out (64 / world a GPU), give one
    GPU's greedy tokens. The tiny model's two key-value heads do not split four ways: four GPUs
    run the 21B shape."""
    for name, (model, prompts, want) in parallel_models.items():
        if world == 4 and name == "tiny":
            continue
        got = _greedy(model, prompts, tensor_parallel_size=world, enable_expert_parallel=expert_parallel,
                      async_scheduling=False, **PARALLEL)
        assert got == want, f"{name} on {world} GPUs"


@pytest.mark.parametrize("world", [pytest.param(2, marks=_gpus(2)), pytest.param(4, marks=_gpus(4))])
def test_several_gpus_with_async_scheduling_give_the_greedy_output_of_one(parallel_models, world):
    """Asynchronous scheduling with ranks (the default): every rank samples the gathered logits
    and feeds its next step from its own GPU's sample, and the tokens are still one GPU's (EP on)."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def use(llm):
        assert llm.engine.core.async_scheduling
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    for name, (model, prompts, want) in parallel_models.items():
        if world == 4 and name == "tiny":
            continue
        got = _on_gpu(model, use, tensor_parallel_size=world, enable_expert_parallel=True, **PARALLEL)
        assert got == want, f"{name} on {world} GPUs"


# --- ERNIE-4.5-21B-A3B's shape at reduced depth against transformers ----------------------------

BF16_RATIO = 1.5  # as test_ernie.py: fd's bf16 error at most 1.5x transformers' own bf16 error
LAYERS = 3  # one dense layer, then two sparse ones (64 experts, top-6, two shared experts)


@pytest.fixture(scope="module")
def ernie_21b(tmp_path_factory):
    """``(plain, dequantized)``: the random checkpoint (bfloat16), and the same with every decoder
    linear replaced by its wint4 quantization (fd's --quantization wint4, group 128, zero
    points; scales and zeros in bfloat16, as cuda's ``pack_linear`` keeps them) dequantized, in
    float32: the model fd runs with --quantization wint4, as transformers can run it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import shutil

    from fd_core.quantization.host import dequantize
    from fd_core.quantization.quantize import LoadQuantization
    from fd_backend_cuda.kernels.quantized_linear import kept
    from safetensors.numpy import save_file
    from safetensors.torch import load_file
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    tmp = tmp_path_factory.mktemp("ernie21b")
    shape = dict(checkpoints.ERNIE_45_21B_A3B, num_hidden_layers=LAYERS, bos_token_id=1, eos_token_id=2,
                 pad_token_id=0)
    plain = checkpoints.make_large_random(tmp, Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM, "plain", **shape)
    dequantized = tmp / "wint4-dequantized"
    shutil.copytree(plain, dequantized)
    tensors = {k: v.float().numpy() for k, v in load_file(str(plain / "model.safetensors")).items()}
    quantize = LoadQuantization("wint4", 128)
    for name, value in tensors.items():
        if name.endswith("_proj.weight"):
            tensors[name] = dequantize(kept(quantize(name, value)))
    save_file(tensors, str(dequantized / "model.safetensors"))
    return plain, dequantized


def _fd_logits(model, prompts, **kw):
    from fd_core.engine.model_runner import prefill_batch, prepare_inputs

    def logits(llm):
        runner = llm.engine.core.executor.runner
        out = []
        for prompt in prompts:
            inputs, _ = prepare_inputs(prefill_batch([prompt], runner.block_size), runner.block_size)
            inputs.logit_rows = np.arange(len(prompt), dtype=np.int64)
            out.append(runner.run(inputs).float())
        return out

    return _on_gpu(model, logits, max_model_len=512, **kw)


def _hf(path, dtype):
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).cuda().eval()


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    vocab = checkpoints.ERNIE_45_21B_A3B["vocab_size"]
    return [rng.integers(3, vocab, size=int(rng.integers(8, 120))).tolist() for _ in range(count)]


@pytest.mark.parametrize("variant", ["plain", "wint4"])
def test_ernie_21b_shape_float32_greedy_tokens_match_transformers(ernie_21b, variant):
    """8 prompts x 64 greedy steps, float32, CUDA graphs on. wint4: fd quantizes the plain
    checkpoint's linears at load; transformers runs the same quantization dequantized."""
    plain, dequantized = ernie_21b
    prompts = _prompts(8)
    extra = {"quantization": "wint4"} if variant == "wint4" else {}
    tokens = _greedy(plain, prompts, steps=64, dtype="float32", max_model_len=512, **extra)
    hf = _hf(dequantized if variant == "wint4" else plain, torch.float32)
    ties = teacher_forced_ties(hf, prompts, tokens)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    print(f"ERNIE-4.5-21B-A3B shape, {LAYERS} layers, {variant}, float32: near-ties {ties}")
    assert ties <= 1


@pytest.mark.parametrize("variant", ["plain", "wint4"])
def test_ernie_21b_shape_bfloat16_logits_within_tolerance(ernie_21b, variant):
    plain, dequantized = ernie_21b
    prompts = _prompts(4)
    extra = {"quantization": "wint4"} if variant == "wint4" else {}
    ours = _fd_logits(plain, prompts, dtype="bfloat16", **extra)
    reference = dequantized if variant == "wint4" else plain
    for dtype in (torch.float32, torch.bfloat16):
        hf = _hf(reference, dtype)
        with torch.no_grad():
            logits = [hf(torch.tensor([p], device="cuda")).logits[0].float() for p in prompts]
        del hf
        gc.collect()
        torch.cuda.empty_cache()
        if dtype == torch.float32:
            exact = logits
        else:
            theirs = logits
    err_fd, err_hf = 0.0, 0.0
    gaps, flips_fd, flips_hf = [], [], []
    for mine, want, their in zip(ours, exact, theirs):
        err_fd = max(err_fd, float((mine - want).abs().max()))
        err_hf = max(err_hf, float((their - want).abs().max()))
        top2 = want.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        flips_fd.append(mine.argmax(-1) != want.argmax(-1))
        flips_hf.append(their.argmax(-1) != want.argmax(-1))
    gap, fd_flip, hf_flip = torch.cat(gaps), torch.cat(flips_fd), torch.cat(flips_hf)
    # a bf16 forward's logits move by up to err_hf, so where float32's top two are further apart
    # than that, no bf16 forward as good as transformers' may choose differently
    clear = gap > err_hf
    print(f"ERNIE-4.5-21B-A3B shape, {LAYERS} layers, {variant}, bfloat16 logits: max |fd - hf fp32| = "
          f"{err_fd:.4f}, max |hf bf16 - hf fp32| = {err_hf:.4f}; argmax differs from fp32's at "
          f"{int(fd_flip.sum())} (fd) and {int(hf_flip.sum())} (hf bf16) of {gap.numel()} positions, "
          f"{int(fd_flip[clear].sum())} (fd) of the {int(clear.sum())} whose top-2 gap exceeds {err_hf:.3f}; "
          f"logit std {float(exact[0].std()):.3f}")
    assert err_fd <= BF16_RATIO * err_hf
    assert int(fd_flip[clear].sum()) == 0


def test_ernie_300b_shape_loads_in_wint4_and_generates(tmp_path):
    """ERNIE-4.5-300B-A47B's shape at four layers (three dense, one sparse of 64 experts of width
    3584, top-8), random weights drawn at load (``--load-format dummy``) straight in wint4: the
    experts are stacked for the fused kernel and the model generates, graphs on."""
    from transformers import Ernie4_5_MoeConfig

    shape = dict(checkpoints.ERNIE_45_300B_A47B, num_hidden_layers=4, moe_layer_end_index=3, bos_token_id=1,
                 eos_token_id=2, pad_token_id=0)
    folder = checkpoints.make_config_only(tmp_path, Ernie4_5_MoeConfig, "ernie45_300b", **shape)

    def check(llm):
        experts = llm.engine.core.executor.runner.model.layers[3].experts
        assert experts.gate_up.qweight.shape[0] == 64 and experts.gate_up.layout == "cuda_w4"
        return llm.generate([[5, 6, 7, 8], list(range(3, 90))],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    outs = _on_gpu(folder, check, load_format="dummy", quantization="wint4", dtype="bfloat16", max_model_len=256,
                   gpu_memory_utilization=0.5)
    assert [len(o.outputs[0].token_ids) for o in outs] == [16, 16]
