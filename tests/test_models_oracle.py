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


@pytest.mark.parametrize("builder, hf_builder", [
    ("make_llama", None),
    ("make_qwen3", None),
    ("make_ernie45", None),
    ("make_ernie45_paddle", "make_ernie45"),
])
def test_logits_match_transformers(tmp_path, builder, hf_builder):
    fd_dir = getattr(checkpoints, builder)(tmp_path / "fd")
    hf_dir = getattr(checkpoints, hf_builder)(tmp_path / "hf") if hf_builder else fd_dir
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
    assert max(errors) <= TOLERANCE, f"per-step relative errors: {errors}"
    # greedy choices follow from the logits
    assert tokens == [int(np.argmax(row)) for row in ours]
