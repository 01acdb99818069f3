"""The CUDA platform end to end: discovery, and greedy tokens equal to transformers' on the GPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def test_cuda_is_discovered_with_honest_capabilities():
    from fd_core.plugins import get_registry

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    platform = get_registry().platform("cuda")
    caps = platform.capabilities()
    assert platform.is_available() == (True, "")
    assert ("bfloat16" in caps.dtypes) == (torch.cuda.get_device_capability(0)[0] >= 8)


def test_without_the_driver_torch_is_not_asked(monkeypatch, tmp_path):
    """No /dev/nvidiaN: unavailable with the sentence, no GPU kernels registered (so no triton
    import), and the manifest without the device's dtypes; runs without a GPU."""
    from fd_core.plugins import OpRegistry

    from fd_backend_cuda import platform, plugin

    monkeypatch.setattr(platform, "DEVICE_NODES", (str(tmp_path / "nvidia[0-9]*"),))
    monkeypatch.delenv("FD_IGNORE_DEVICE_NODES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("torch was asked"))
    p = platform.CudaPlatform()
    ok, why = p.is_available()
    assert not ok and why.startswith(f"no cuda device: none of {tmp_path}/nvidia[0-9]* exists")
    caps = p.capabilities()
    assert caps.device_count == 0 and "bfloat16" not in caps.dtypes
    registry = OpRegistry()
    plugin.fd_register_ops(registry)
    assert not registry.implementations("attention", "cuda")


def test_greedy_tokens_are_transformers_argmax_on_the_gpu(llama):
    """fd's 64 greedy tokens, fed back to transformers (float32, same GPU) in one forward: each
    is its argmax at that position. Teacher forcing, because transformers' own generate() decodes
    with a different kernel mix and, on a random-weight model whose top two logits can be 5e-5
    apart, its incremental path itself drifts from its full forward."""
    from fd_core import LLM, SamplingParams
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 400, size=int(rng.integers(4, 40))).tolist() for _ in range(8)]
    llm = LLM(model=str(llama), device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256)
    assert llm.engine.core.ops.choices["attention"].impl.name == "triton-attention"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).cuda().eval()
    torch.backends.cuda.matmul.allow_tf32 = False
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0]
        argmax = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()
        assert tokens == argmax
