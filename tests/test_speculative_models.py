"""Proposers with a model of their own (``draft_model``, ``mtp``) on tiny random-weight Llama and
ERNIE 4.5 checkpoints in float32: the output is the engine's without speculation whatever they
propose; a draft that is the target itself proposes exactly the target's tokens, so every draft
holds — under preemption, chunking, a tight KV cache and prefix-cache hits too, which shows its
cache layers stay right; the MTP layer's drafts are what transformers computes for that layer."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")  # the checkpoints are built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.errors import ConfigError  # noqa: E402
from fd_core.testing.models import write_mtp_weights  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.test_async_scheduling import async_cpu  # noqa: E402, F401 - a fixture
from tests.test_speculative_engine import GREEDY, SEEDED, prompts, run, tokens  # noqa: E402

VARIANTS = {
    "plain": {},
    "recompute": {"num_kv_blocks": 4 * 15 + 1},
    "swap": {"num_kv_blocks": 4 * 15 + 1, "swap_space": 0.01},
    "chunked": {"max_num_batched_tokens": 7},
    "threshold": {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 4},
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    return write_mtp_weights(checkpoints.make_ernie45(tmp_path_factory.mktemp("ernie")))


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """Another Llama of the target's vocabulary, one layer, other weights."""
    return checkpoints.make_llama(tmp_path_factory.mktemp("draft"), seed=9, num_hidden_layers=1)


@pytest.fixture(scope="module")
def references(llama, ernie):
    return {(name, kind): tokens(run(folder, params)[0]) for kind, folder in (("llama", llama), ("ernie", ernie))
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


def spec_stats(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k.startswith("spec")}


@pytest.mark.parametrize("kind", ["llama", "ernie"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_draft_that_is_the_target_accepts_every_draft(llama, ernie, references, kind, variant):
    folder = llama if kind == "llama" else ernie
    config = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    outs, stats = run(folder, GREEDY, config, **VARIANTS[variant])
    assert tokens(outs) == references[("greedy", kind)]
    assert stats["spec_draft_tokens"] > 100 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"], \
        spec_stats(stats)
    if "num_kv_blocks" in VARIANTS[variant]:
        assert stats["preemptions"] > 0


def test_the_draft_cache_is_right_in_prefix_cache_hits_and_forks(llama):
    """The same prompts again take their blocks from the prefix cache, the draft's layers with
    them (published once the draft had computed them too); n = 2 forks copy both."""
    config = {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 3}
    llm = LLM(model=str(llama), max_model_len=128, block_size=4, num_kv_blocks=512, speculative_config=config)
    base = LLM(model=str(llama), max_model_len=128, block_size=4, num_kv_blocks=512)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)  # greedy: the draft's own rule
    want = tokens(base.generate(prompts(), params, use_tqdm=False))
    for _ in range(2):
        got = llm.generate(prompts(), params, use_tqdm=False)
        assert tokens(got) == want
    stats = llm.engine.stats
    assert sum(o.num_cached_tokens for o in got) > 0
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, spec_stats(stats)
    assert llm.engine.pool.num_free == llm.engine.pool.capacity


@pytest.mark.parametrize("proposer", ["draft", "mtp"])
@pytest.mark.parametrize("name, params", [("greedy", GREEDY), ("seeded", SEEDED)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_other_proposers_leave_the_output_unchanged(llama, ernie, small_draft, references, proposer, name, params,
                                                    variant):
    if proposer == "draft":
        folder, kind = llama, "llama"
        config = {"method": "draft_model", "model": str(small_draft), "num_speculative_tokens": 3}
    else:
        folder, kind = ernie, "ernie"
        config = {"method": "mtp", "num_speculative_tokens": 2}
    outs, stats = run(folder, params, config, **VARIANTS[variant])
    assert tokens(outs) == references[(name, kind)]
    assert stats["spec_draft_tokens"] > 100


def _rms(x, w, eps):
    import torch

    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@pytest.mark.oracle
def test_mtp_drafts_are_the_layers_prediction(ernie):
    """The first two drafts after a prompt are the argmax of the MTP layer computed with
    transformers' ERNIE 4.5 layer: at each position p, the target's final hidden state and the
    embedding of the token at p + 1 (the sampled one at the end), then one more position on the
    layer's own hidden state and the first draft."""
    import torch
    from safetensors.numpy import load_file
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM, Ernie4_5Model

    target = Ernie4_5ForCausalLM.from_pretrained(str(ernie), dtype=torch.float32).eval()
    cfg = target.config
    mtp = load_file(str(ernie / "mtp.safetensors"))
    layer = Ernie4_5Model(Ernie4_5Config(**{**cfg.to_dict(), "num_hidden_layers": 1})).eval()
    state = {k.replace("model.mtp_block.0.", "layers.0."): torch.from_numpy(v) for k, v in mtp.items()
             if k.startswith("model.mtp_block.0.")}
    state["norm.weight"] = target.model.norm.weight.detach()
    state["embed_tokens.weight"] = target.model.embed_tokens.weight.detach()
    layer.load_state_dict(state)
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    proj = torch.from_numpy(mtp["model.mtp_linear_proj.0.weight"])
    enorm, hnorm = (torch.from_numpy(mtp[f"model.mtp_{n}_norm.0.weight"]) for n in ("emb", "hidden"))

    def mtp_inputs(next_ids, hidden):
        emb = target.model.embed_tokens(next_ids)
        return _rms(emb, enorm, eps) @ proj[:, :h].T + _rms(hidden, hnorm, eps) @ proj[:, h:].T

    llm = LLM(model=str(ernie), max_model_len=128, block_size=4, num_kv_blocks=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    core = llm.engine.core
    drafts = []
    original = core.proposer.propose

    def spy(scheduled, decoding):
        original(scheduled, decoding)
        drafts.extend((list(seq.output_token_ids), list(seq.draft_token_ids)) for seq in decoding)

    core.proposer.propose = spy
    prompt = prompts(1)[0]
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    (output, got), *_ = drafts  # after the prefill step: the first sampled token and two drafts
    with torch.no_grad():
        ids = torch.tensor([prompt + output])
        hidden = target.model(ids).last_hidden_state[0]  # [L + 1, H], after the final norm
        x = mtp_inputs(ids[0, 1:], hidden[:-1])  # positions 0..L-1: token p + 1 and h_p
        out = layer(inputs_embeds=x[None], position_ids=torch.arange(len(x))[None]).last_hidden_state[0]
        first = int((out[-1] @ target.lm_head.weight.T).argmax())
        x2 = torch.cat([x, mtp_inputs(torch.tensor([first]), out[-1:])])
        out2 = layer(inputs_embeds=x2[None], position_ids=torch.arange(len(x2))[None]).last_hidden_state[0]
        second = int((out2[-1] @ target.lm_head.weight.T).argmax())
    assert got == [first, second]


def test_bad_proposers_stop_start_up(llama, ernie, tmp_path):
    other = checkpoints.make_llama(tmp_path / "other-vocab", vocab_size=600)
    with pytest.raises(ConfigError, match=r"^--speculative-config: the draft model .* has a vocabulary of 600 "
                                          r"tokens and the target 512"):
        LLM(model=str(llama), max_model_len=64, num_kv_blocks=64,
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"^--speculative-config: method 'mtp' needs the MTP layer's weights "
                                          r"\(model.mtp_\*\), and .*llama has none"):
        LLM(model=str(llama), max_model_len=64, num_kv_blocks=64,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ConfigError, match=r"^--speculative-config: num_speculative_tokens must be an integer from 1 "
                                          r"to 16, got 0"):
        LLM(model=str(llama), speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_two_tensor_parallel_ranks_with_a_draft(llama):
    """Every rank runs the draft's share of the work; rank 0's drafts are every rank's."""
    config = {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 2}
    llm = LLM(model=str(llama), max_model_len=128, block_size=4, num_kv_blocks=256, tensor_parallel_size=2,
              speculative_config=config)
    try:
        base = LLM(model=str(llama), max_model_len=128, block_size=4, num_kv_blocks=256)
        got = tokens(llm.generate(prompts(4), GREEDY, use_tqdm=False))
        assert got == tokens(base.generate(prompts(4), GREEDY, use_tqdm=False))
        stats = llm.engine.stats
        assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0
    finally:
        llm.engine.core.shutdown()


def test_draft_passes_chained_on_the_device(llama, references, async_cpu):  # noqa: F811
    """With the op table's sample_async (registered here for the cpu device) each draft pass
    takes the drafts before it through ``PendingSample.feed`` and the host reads them all at
    the end: the same drafts, every one accepted."""
    from tests.test_async_scheduling import HostFed

    config = {"method": "draft_model", "model": str(llama), "num_speculative_tokens": 3}
    outs, stats = run(llama, GREEDY, config)
    assert HostFed.fed > 0  # the passes were fed on the "device"
    assert tokens(outs) == references[("greedy", "llama")]
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 100, spec_stats(stats)
