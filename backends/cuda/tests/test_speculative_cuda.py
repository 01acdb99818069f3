"""Speculative decoding on the GPU (issue 19): n-gram, draft-model and MTP proposals, verified in
captured graphs of verification steps (every sequence padded to k drafts) and eagerly, give the
tokens of the engine without speculation in float32 — greedy, and seeded with an oracle that
proposes mostly right drafts; a draft that is the target accepts (nearly) every draft."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu


def _generate(path, params, speculative=None, enforce_eager=False, oracle=None, prompts=None, twice=False):
    """Tokens of an engine made for this call (its device memory given back before the next
    one sizes its KV cache), its stats, and its graphed forward's verification replays and
    captured shapes."""
    import gc

    from fd_core import LLM
    from tests.test_speculative_engine import Oracle
    from tests.test_speculative_engine import prompts as test_prompts

    llm = LLM(model=str(path), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16, block_size=16,
              enforce_eager=enforce_eager, gpu_memory_utilization=0.3, speculative_config=speculative)
    if oracle is not None:
        llm.engine.core.proposer = Oracle(oracle)
    runs = []
    for _ in range(2 if twice else 1):  # twice: the second run from the prefix cache
        outs = llm.generate(prompts or test_prompts(12), params, use_tqdm=False)
        runs.append([[o.token_ids for o in out.outputs] for out in outs])
        assert llm.engine.pool.num_free == llm.engine.pool.capacity
    core = llm.engine.core
    forward = core.executor.runner.forward
    info = {"stats": dict(core.stats), "async": core.async_scheduling,
            "verify_replays": getattr(forward, "verify_replays", 0),
            "shapes": sorted({q for _, q in getattr(forward, "graphs", {})})}
    core.shutdown()
    del llm, core, forward
    gc.collect()
    torch.cuda.empty_cache()
    return (runs if twice else runs[0]), info


@pytest.fixture(scope="module")
def ernie_mtp(tmp_path_factory):
    from fd_core.testing.models import write_mtp_weights
    from tests import checkpoints

    return write_mtp_weights(checkpoints.make_ernie45(tmp_path_factory.mktemp("ernie-mtp")))


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_proposers_on_cuda_keep_the_greedy_tokens(llama, ernie_mtp, eager):
    from tests.test_speculative_engine import GREEDY

    cases = [
        (llama, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
        (llama, {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 3}),
        (ernie_mtp, {"method": "mtp", "num_speculative_tokens": 2}),
    ]
    for path, config in cases:
        want, _ = _generate(path, GREEDY, enforce_eager=eager)
        got, info = _generate(path, GREEDY, config, enforce_eager=eager)
        method, stats = config["method"], info["stats"]
        assert info["async"] is False  # turned off for speculation
        assert got == want, method
        assert stats["spec_draft_tokens"] > 50, method
        if not eager:
            assert info["verify_replays"] > 0, method  # padded to k drafts: one graph shape
        if method == "draft_model":  # the target itself: its drafts are its tokens
            assert stats["spec_accepted_tokens"] >= 0.95 * stats["spec_draft_tokens"], stats


def test_seeded_sampling_with_drafts_on_cuda(llama):
    """cuda's Triton sampler draws each verification row as a plain step draws that position."""
    from tests.test_speculative_engine import SEEDED, prompts

    want, _ = _generate(llama, SEEDED)
    oracle = {tuple(p): ref for p, ref in zip(prompts(12), want)}
    got, info = _generate(llama, SEEDED, {"method": "ngram", "num_speculative_tokens": 3}, oracle=oracle)
    assert got == want
    assert 0 < info["stats"]["spec_accepted_tokens"] < info["stats"]["spec_draft_tokens"]
    assert info["verify_replays"] > 0


def test_verification_graphs_pad_rows_inertly(llama):
    """Buckets larger than the batch: the padding rows write nothing to the cache, so a
    second run of the same prompts (prefix-cache hits) gives the same tokens."""
    from fd_core import SamplingParams
    from tests.test_speculative_engine import prompts

    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (first, again), info = _generate(llama, params, {"method": "draft_model", "model": str(llama),
                                                     "num_speculative_tokens": 4}, prompts=prompts(5), twice=True)
    assert first == again
    assert info["shapes"] == [1, 5] and info["verify_replays"] > 0
