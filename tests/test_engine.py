"""Engine behaviour on a tiny random-weight Llama: scheduling choices never change outputs."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine import detokenizer  # noqa: E402
from tests import checkpoints  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("engine"))


def prompts(n: int, vocab: int = 400) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(3, vocab, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def run(model_dir, params, **engine_args):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, **engine_args)
    outs = llm.generate(prompts(16), params, use_tqdm=False)
    pool = llm.engine.pool
    assert pool.num_free == pool.capacity
    return [o.outputs[0].token_ids for o in outs], llm.engine.stats


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_preemption_and_chunking_do_not_change_outputs(model_dir, params):
    reference, stats = run(model_dir, params, num_kv_blocks=512)
    assert stats["preemptions"] == 0
    # room for about four sequences at a time: the scheduler must preempt and recompute
    tight, stats = run(model_dir, params, num_kv_blocks=4 * 15 + 1)
    assert stats["preemptions"] > 0
    assert tight == reference
    chunked, _ = run(model_dir, params, num_kv_blocks=512, max_num_batched_tokens=7)
    assert chunked == reference
    unchunked, _ = run(model_dir, params, num_kv_blocks=512, max_num_batched_tokens=64,
                       enable_chunked_prefill=False)
    assert unchunked == reference
    few_seqs, _ = run(model_dir, params, num_kv_blocks=512, max_num_seqs=3)
    assert few_seqs == reference


def test_min_tokens_suppresses_stop_tokens(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    prompt = prompts(1)[0]
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    token = first.outputs[0].token_ids[0]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[token]),
                           use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == [token] and stopped.finish_reason == "stop" and stopped.stop_reason == token
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=3,
                                                 stop_token_ids=[token]), use_tqdm=False)[0].outputs[0]
    assert token not in held.token_ids[:3] and len(held.token_ids) >= 3


def test_incremental_detokenization_equals_full_decode(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    tok = llm.get_tokenizer()
    text = "naïve café 東京 🎉 — ok\n  done"
    ids = tok.encode(text, add_special_tokens=False)
    state = detokenizer.TextState([5, 6], SamplingParams())
    pieces = []
    for t in ids:
        state.output_token_ids.append(t)
        pieces.append(detokenizer.append_text(tok, state))
    assert "".join(pieces) == state.text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
