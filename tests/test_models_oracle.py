"""Random-weight Llama, Qwen3 and ERNIE 4.5 (HF and Paddle layout): fd's logits against
transformers' on the same weights, for a prefill and 16 decode steps (float32, CPU).

Tolerance: max |fd - hf| / max |hf| <= 1e-4 at every step.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.oracle

from fd_core import LLM  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.oracle import fd_greedy_logits, hf_logits, relative_error  # noqa: E402

TOLERANCE = 1e-4
STEPS = 17  # the prefill's sampled row + 16 decode steps


def make_llama3(tmp):
    """Llama 3.1-style rope scaling: low frequencies stretched by the "llama3" rule."""
    return checkpoints.make_llama(tmp, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def make_ernie45_biased(tmp):
    return checkpoints.make_ernie45(tmp, use_bias=True)


def make_qwen3_biased(tmp):
    return checkpoints.make_qwen3(tmp, attention_bias=True)


@pytest.mark.parametrize("builder, hf_builder", [
    (checkpoints.make_llama, None),
    (make_llama3, None),
    (checkpoints.make_qwen3, None),
    (make_qwen3_biased, None),
    (checkpoints.make_ernie45, None),
    (make_ernie45_biased, None),
    (checkpoints.make_ernie45_paddle, checkpoints.make_ernie45),
], ids=["llama", "llama3-rope-scaling", "qwen3", "qwen3-bias", "ernie45", "ernie45-bias", "ernie45-paddle"])
def test_logits_match_transformers(tmp_path, builder, hf_builder):
    fd_dir = builder(tmp_path / "fd")
    hf_dir = hf_builder(tmp_path / "hf") if hf_builder else fd_dir
    rng = np.random.default_rng(0)
    llm = LLM(model=str(fd_dir), block_size=4, num_kv_blocks=64, max_model_len=128)
    vocab = llm.engine.model_config.vocab_size
    prompt = rng.integers(0, vocab, size=11).tolist()
    tokens, ours = fd_greedy_logits(llm, prompt, STEPS)
    assert len(tokens) == STEPS
    full = prompt + tokens[:-1]
    theirs = hf_logits(hf_dir, full)[len(prompt) - 1 :]
    assert ours.shape == theirs.shape
    errors = [relative_error(ours[i], theirs[i]) for i in range(STEPS)]
    print(f"max relative error over {STEPS} steps: {max(errors):.2e}")
    assert max(errors) <= TOLERANCE, f"per-step relative errors: {errors}"
    # greedy choices follow from the logits
    assert tokens == [int(np.argmax(row)) for row in ours]
