"""Greedy generation end to end on a small random-weight Llama (``fd_core.testing.models``):
the backend's tokens are the specification's own greedy continuation, up to near-ties."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from fd_core.testing.models import TinyLlama, greedy_reference, write_checkpoint, write_mtp_weights

MAX_TOKENS = 12
PROMPT_LENGTHS = (5, 19, 40)
# How close (in log-probability) the spec's best token and the backend's choice may be where
# they part: rounding decides such near-ties, so the rest of that sequence is not compared.
NEAR_TIE = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 1e-1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    shape = TinyLlama()
    folder = tmp_path_factory.mktemp("fd-conformance-llama")
    weights = write_checkpoint(folder, shape)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, shape.vocab_size - 1, n).tolist() for n in PROMPT_LENGTHS]
    expected = [greedy_reference(weights, shape, p, MAX_TOKENS) for p in prompts]
    return folder, prompts, expected


def _generate(fd_backend, folder, prompts, **engine_args) -> list[list[int]]:
    from fd_core import LLM, SamplingParams

    llm = LLM(str(folder), device=fd_backend.device, runtime=fd_backend.runtime,
              dtype=fd_backend.dtype, max_model_len=128, max_num_seqs=4, num_kv_blocks=48,
              **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    # again, in one batch: the prompts' blocks are now cached where prefix caching is on
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert second == first, f"the same greedy requests gave other tokens the second time: {first} then {second}"
    return first


def _check(fd_backend, got: list[list[int]], expected, what: str) -> None:
    gap = NEAR_TIE[fd_backend.dtype]
    for i, (tokens, (want, logprobs)) in enumerate(zip(got, expected)):
        assert len(tokens) == MAX_TOKENS, f"{what}: prompt {i} gave {len(tokens)} tokens, asked for {MAX_TOKENS}"
        for step, (a, b) in enumerate(zip(tokens, want)):
            if a == b:
                continue
            margin = float(logprobs[step][b] - logprobs[step][a])
            assert margin <= gap, (
                f"{what}: prompt {i} (length {PROMPT_LENGTHS[i]}) step {step}: the backend chose token {a}, the "
                f"spec {b}, which is {margin:.3g} more likely (near-tie allowance {gap}); backend {tokens}, spec {want}")
            break  # a near-tie: what follows depends on it


def test_greedy_generation_matches_the_spec(fd_backend, tiny):
    fd_backend.require()
    folder, prompts, expected = tiny
    _check(fd_backend, _generate(fd_backend, folder, prompts), expected, "greedy generation")


def test_chunked_prefill_where_declared(fd_backend, tiny):
    """Prompts split into 16-token steps, mixed with the other sequences' decodes."""
    fd_backend.require()
    if not fd_backend.capabilities.chunked_prefill:
        pytest.skip("chunked_prefill is not declared (the flag is refused at start-up instead)")
    folder, prompts, expected = tiny
    got = _generate(fd_backend, folder, prompts, enable_chunked_prefill=True, max_num_batched_tokens=16)
    _check(fd_backend, got, expected, "chunked prefill")


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_speculative_methods_where_declared(fd_backend, tiny, tmp_path, method):
    """Each declared speculative method: drafts verified in multi-token decode rows (their
    tokens sampled by the backend's ``sample``) leave the greedy continuation as it was. The
    draft model is the model itself; the MTP layer has random weights."""
    from fd_core import LLM, SamplingParams

    fd_backend.require()
    if method not in fd_backend.capabilities.speculative_methods:
        pytest.skip(f"{method} is not declared (--speculative-config refuses it at start-up)")
    folder, prompts, expected = tiny
    config = {"method": method, "num_speculative_tokens": 3}
    if method == "ngram":
        config["prompt_lookup_min"] = 1
    elif method == "draft_model":
        config["model"] = str(folder)
    else:  # the MTP layer's weights beside a copy of the model
        shutil.copytree(folder, tmp_path / "with-mtp")
        folder = tmp_path / "with-mtp"
        write_mtp_weights(folder)
    llm = LLM(str(folder), device=fd_backend.device, runtime=fd_backend.runtime, dtype=fd_backend.dtype,
              max_model_len=128, max_num_seqs=4, num_kv_blocks=48, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine.stats["spec_draft_tokens"] > 0, f"{method}: no draft was verified"
    _check(fd_backend, got, expected, f"speculative decoding ({method})")
