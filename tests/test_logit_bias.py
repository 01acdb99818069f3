"""OpenAI's ``logit_bias`` in the engine: SamplingParams' checks, the vocabulary check at the
door, the bias moving greedy and seeded outputs of a random-weight model (synchronous and
asynchronous scheduling, rows with and without a bias in one batch), and a plugin whose sample
ops predate API 1.11 refusing biased requests by name rather than sampling without the bias."""

from __future__ import annotations

import msgspec
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams
from fd_core.engine.wire import AddRequest, params_from_wire, params_to_wire
from fd_core.engine.sampling_params import MAX_LOGIT_BIAS
from fd_core.errors import InvalidRequestError
from fd_core.plugins import registry as registry_module
from fd_core.plugins.registry import BackendRegistry
from tests import checkpoints
from tests.test_async_scheduling import HostFed, async_cpu  # noqa: F401 - the fixture

PROMPTS = ["the first prompt", "another one, longer than the first", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("bias"))


def make_llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=256)


def tokens(llm: LLM, params, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.pool.num_free == llm.engine.pool.capacity
    return [list(c.token_ids) for o in outs for c in o.outputs]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, **kw)


# -- the request ----------------------------------------------------------------------------


@pytest.mark.parametrize("bias, words", [
    ({"abc": 1.0}, "keys must be token ids"),
    ({"-1": 1.0}, "keys must be token ids"),
    ({1.5: 1.0}, "keys must be token ids"),
    ({True: 1.0}, "keys must be token ids"),
    ({2**31: 1.0}, "keys must be token ids"),
    ({5: 100.5}, r"values must be numbers in \[-100, 100\]"),
    ({5: -101}, r"values must be numbers in \[-100, 100\]"),
    ({5: float("nan")}, "values must be numbers"),
    ({5: float("inf")}, "values must be numbers"),
    ({5: "1"}, "values must be numbers"),
    ({5: True}, "values must be numbers"),
    ({"5": 1.0, 5: 2.0}, "names token 5 twice"),
    ([5, 1.0], "must map token ids to biases"),
    ({i: 0.0 for i in range(MAX_LOGIT_BIAS + 1)}, f"at most {MAX_LOGIT_BIAS} tokens"),
])
def test_bad_biases_name_the_field(bias, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


def test_json_keys_parse_and_the_wire_keeps_the_bias():
    params = SamplingParams(logit_bias={"7": 1, 3: -100, "0": 100.0})
    assert params.logit_bias == {7: 1.0, 3: -100.0, 0: 100.0}
    assert SamplingParams(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS)}).biased
    assert not SamplingParams(logit_bias={}).biased and not SamplingParams().biased
    message = AddRequest("r", [1, 2], params_to_wire(params))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=AddRequest)
    assert params_from_wire(back.params) == params


def test_ids_past_the_vocabulary_are_refused_at_the_door(model_dir):
    llm = make_llm(model_dir)
    vocab = llm.engine.core.model_config.vocab_size
    with pytest.raises(InvalidRequestError, match=f"below the vocabulary size {vocab}, got \\[{vocab}\\]") as info:
        llm.generate(PROMPTS, greedy(logit_bias={3: 1.0, vocab: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias"
    assert llm.engine.pool.num_free == llm.engine.pool.capacity  # nothing was queued
    assert tokens(llm, greedy(logit_bias={vocab - 1: 1.0}))


# -- the engine -----------------------------------------------------------------------------


def test_a_bias_moves_greedy_output_and_only_its_own(model_dir):
    llm = make_llm(model_dir)
    plain = tokens(llm, greedy())
    target = next(t for t in range(3, 500) if all(t not in out for out in plain))
    assert tokens(llm, greedy(logit_bias={target: 100})) == [[target] * 6] * len(PROMPTS)
    banned = tokens(llm, greedy(logit_bias={str(out[0]): -100 for out in plain}))
    for out, was in zip(banned, plain):
        assert out[0] != was[0] and not {o[0] for o in plain} & set(out)
    assert tokens(llm, greedy()) == plain  # the same request without bias, after the others
    # rows with and without a bias in one batch
    mixed = llm.generate(PROMPTS, [greedy(), greedy(logit_bias={target: 100}), greedy()], use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in mixed]
    assert got[1] == [target] * 6 and got[0] == plain[0] and got[2] == plain[2]


def test_a_bias_is_added_to_the_logit(model_dir):
    """The raw logprobs give the gap between the best token and the runner-up: a bias on the
    runner-up a little over that gap flips the choice, a little under it does not (and the
    logprobs reported stay the unbiased model's)."""
    llm = make_llm(model_dir)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
    top = out.outputs[0].logprobs[0]
    (best, lp_best), (second, lp_second) = sorted(((t, lp.logprob) for t, lp in top.items()), key=lambda x: -x[1])[:2]
    gap = lp_best - lp_second
    assert gap > 0.02

    def first(bias: float) -> tuple[int, float]:
        [o] = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=1, logprobs=0,
                                                         logit_bias={second: bias}), use_tqdm=False)
        token = o.outputs[0].token_ids[0]
        return token, o.outputs[0].logprobs[0][token].logprob

    assert first(gap - 0.01)[0] == best
    token, logprob = first(gap + 0.01)
    assert token == second and logprob == pytest.approx(lp_second, abs=1e-5)


def test_seeded_sampling_and_forks_follow_the_bias(model_dir):
    llm = make_llm(model_dir)
    params = {"temperature": 1.0, "seed": 5, "max_tokens": 8, "ignore_eos": True, "n": 2}
    plain = tokens(llm, SamplingParams(**params))
    assert tokens(llm, SamplingParams(**params)) == plain  # seeded: repeatable
    forced = tokens(llm, SamplingParams(logit_bias={42: 100}, **params))
    assert forced == [[42] * 8] * (2 * len(PROMPTS))
    # every token the unbiased run drew, banned: none of them comes back
    drawn = {t for out in plain for t in out}
    banned = tokens(llm, SamplingParams(logit_bias=dict.fromkeys(drawn, -100), **params))
    assert not drawn & {t for out in banned for t in out}


@pytest.mark.parametrize("params", [
    greedy(logit_bias={9: 3.0, 17: -2.5}),
    greedy(logit_bias={9: 3.0, 17: -2.5}, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, seed=3, max_tokens=8, n=2, ignore_eos=True, logit_bias={11: 4.0}),
], ids=["greedy", "greedy-penalised", "seeded-forks"])
def test_async_scheduling_gives_the_synchronous_outputs(async_cpu, model_dir, params):  # noqa: F811
    sync = tokens(LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=256,
                      async_scheduling=False), params)
    before = HostFed.fed
    llm = make_llm(model_dir)
    assert tokens(llm, params) == sync
    # a penalised row needs the tokens so far, so its steps are read before the next is queued
    assert llm.engine.core.async_scheduling and (HostFed.fed > before) != params.penalised


# -- plugins written before API 1.11 --------------------------------------------------------


def _registry_with(op: str, source: str, api: str) -> BackendRegistry:
    from fd_core.runtimes.paddle.ops import REFERENCE_OPS

    sample = REFERENCE_OPS["sample"]
    fn = sample if op == "sample" else (lambda logits, batch: HostFed(sample(logits, batch)))
    registry = BackendRegistry()
    with registry.ops.registering(source, api):
        registry.ops.register(op, "cpu", fn, name=f"plugin-{op}", priority=5, runtime="paddle")
    return registry


@pytest.mark.parametrize("op", ["sample", "sample_async"])
def test_a_sample_op_older_than_the_bias_refuses_it_at_the_door(monkeypatch, model_dir, op):
    """Its sample ops would drop the bias silently: the request is refused, naming the field,
    the op, the package and its version; requests without a bias run as before."""
    monkeypatch.setattr(registry_module, "_registry", _registry_with(op, "fd-backend-old", "1.10"))
    llm = make_llm(model_dir)
    with pytest.raises(InvalidRequestError, match=rf"logit_bias is unavailable: on the cpu backend, its {op} op "
                                                  rf"\(plugin-{op}, from fd-backend-old\) was written for plugin "
                                                  r"API 1\.10, before 1\.11") as info:
        llm.generate(PROMPTS, greedy(logit_bias={5: 1.0}), use_tqdm=False)
    assert info.value.param == "logit_bias"
    assert tokens(llm, greedy(logit_bias={}))  # an empty map asks for nothing
    assert tokens(llm, greedy())
    assert set(llm.engine.core.unavailable()) == {"logit_bias"}


def test_a_sample_op_of_api_1_11_takes_the_bias(monkeypatch, model_dir):
    monkeypatch.setattr(registry_module, "_registry", _registry_with("sample", "fd-backend-new", "1.11"))
    llm = make_llm(model_dir)
    assert llm.engine.core.unavailable() == {}
    assert tokens(llm, greedy(logit_bias={42: 100})) == [[42] * 6] * len(PROMPTS)
