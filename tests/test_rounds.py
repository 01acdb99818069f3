"""Multi-step decoding (``num_scheduler_steps``, engine/rounds.py): a step of decodes only runs
as a round of device steps, each fed from the sample before it, the host reading the round's
tokens once. On the CPU a test registers a ``sample_async`` (tests/plugins/host_fed.py), as
the asynchronous-scheduling tests do; every path must give the synchronous engine's outputs,
leak no block or placeholder, and publish only real tokens' blocks in the prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine import rounds  # noqa: E402
from fd_core.engine.model_runner import PLACEHOLDER, prepare_inputs  # noqa: E402
from fd_core.engine.scheduler import ScheduledSeq  # noqa: E402
from fd_core.engine.sequence import Sequence  # noqa: E402
from fd_core.errors import ConfigError  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.plugins.host_fed import async_cpu_registry  # noqa: E402
from tests.test_async_scheduling import MIXED, PARAMS, SETTINGS, generate, prompts  # noqa: E402

ROUND = 4


@pytest.fixture()
def async_cpu(monkeypatch):
    return async_cpu_registry(monkeypatch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("rounds"))


def compare(model_dir, params, prompt_list=None, rounds_run=True, **engine_args):
    """The synchronous engine's outputs, which the engine with rounds must equal; whether
    it ran rounds is checked against ``rounds_run``."""
    _, sync = generate(model_dir, params, prompt_list, async_scheduling=False, **engine_args)
    llm, got = generate(model_dir, params, prompt_list, num_scheduler_steps=ROUND, **engine_args)
    assert (llm.engine.stats["rounds"] > 0) == rounds_run
    assert [[c[:3] for c in o] for o in got] == [[c[:3] for c in o] for o in sync]
    # a round computes rows for sequences that stopped in it: the float32 sums may round differently
    np.testing.assert_allclose([c[3] for o in got for c in o], [c[3] for o in sync for c in o], rtol=1e-5)
    return sync, llm


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
def test_rounds_give_the_synchronous_outputs(async_cpu, model_dir, setting, params):
    """Seeded rows draw each round step's noise as the step it stands for would: same tokens."""
    compare(model_dir, params, **SETTINGS[setting])


def test_max_tokens_not_a_multiple_of_the_round(async_cpu, model_dir):
    """Each sequence its own max_tokens: rounds run past some sequences' last token (those rows
    are dropped) and stop after the longest one's."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 6, 7, 9, 13)]
    compare(model_dir, params, prompts(8), num_kv_blocks=512)


def test_stops_mid_round_drop_the_rest(async_cpu, model_dir):
    """A stop id read in the middle of a round ends its sequence there: the round's later
    tokens and the next round queued meanwhile are dropped, its blocks freed."""
    _, sync = generate(model_dir, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       async_scheduling=False, num_kv_blocks=512)
    stop_ids = sorted({out[0][0][5] for out in sync})[:4]  # sixth tokens of some prompts
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids)
    result, _ = compare(model_dir, params, num_kv_blocks=512)
    assert sum(out[0][1] == "stop" for out in result) >= 2
    assert all(PLACEHOLDER not in out[0][0] for out in result)


def test_stop_strings_end_the_text_inside_a_round(async_cpu, model_dir):
    """A stop string the text reaches at a round's middle token ends it there: the tokens, the
    stop reason and the cumulative logprob are the synchronous engine's (the output processor
    takes a request with stop strings token by token from a round's output)."""
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, async_scheduling=False)
    texts = [o.outputs[0].text for o in llm.generate(prompts(12), SamplingParams(temperature=0, max_tokens=20,
                                                                                   ignore_eos=True), use_tqdm=False)]
    stops = sorted({t[6:9] for t in texts if len(t) > 12})[:4]  # from inside some outputs
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stops)
    result, _ = compare(model_dir, params, num_kv_blocks=512)
    assert sum(out[0][1] == "stop" for out in result) >= 2


def test_max_model_len_bounds_a_round(async_cpu, model_dir):
    """Sequences that run into max_model_len: no round step computes a position past it."""
    long = [list(range(3, 3 + n)) for n in (57, 59, 60, 62, 30)]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    got = {}
    for name, args in (("sync", {"async_scheduling": False}), ("rounds", {"num_scheduler_steps": ROUND})):
        llm = LLM(model=str(model_dir), max_model_len=64, block_size=4, num_kv_blocks=512, **args)
        outs = llm.generate(long, params, use_tqdm=False)
        got[name] = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
        assert llm.engine.pool.num_free == llm.engine.pool.capacity
    assert got["rounds"] == got["sync"]
    assert [len(t) for t, _ in got["rounds"]] == [7, 5, 4, 2, 34]
    assert {r for _, r in got["rounds"]} == {"length"}
    assert llm.engine.stats["rounds"] > 0


def test_what_reads_the_round_s_tokens_runs_step_by_step(async_cpu, model_dir):
    """Penalties, forks, prompt logprobs and min_tokens beside plain rows: equal outputs, and
    a batch with only penalised rows never runs a round."""
    compare(model_dir, MIXED * 2, prompts(10), num_kv_blocks=512)
    compare(model_dir, SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True,
                                      repetition_penalty=1.3), prompts(6), rounds_run=False, num_kv_blocks=512)
    compare(model_dir, SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[7, 9, 11]),
            prompts(6), num_kv_blocks=512)


def test_the_prefix_cache_publishes_real_tokens(async_cpu, model_dir):
    """A round's later tokens are placeholders on the host until read: the blocks holding them
    join the prefix cache only after. A second request whose prompt is a first one's prompt and
    output hits as many cached tokens as under the synchronous engine."""
    first = prompts(3, seed=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    hits = {}
    for name, args in (("sync", {"async_scheduling": False}), ("rounds", {"num_scheduler_steps": ROUND})):
        llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, **args)
        outs = llm.generate(first, params, use_tqdm=False)
        again = [p + list(o.outputs[0].token_ids) for p, o in zip(first, outs)]
        second = llm.generate(again, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        hits[name] = ([o.num_cached_tokens for o in second], [list(o.outputs[0].token_ids) for o in second])
        assert llm.engine.pool.num_free == llm.engine.pool.capacity
    assert hits["rounds"] == hits["sync"]
    assert all(h >= len(p) for h, p in zip(hits["sync"][0], first))  # the outputs' blocks were cached


def test_num_scheduler_steps_refused_where_it_cannot_run(model_dir, async_cpu):
    with pytest.raises(ConfigError, match="num_scheduler_steps must be a positive integer"):
        LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, num_scheduler_steps=0)
    with pytest.raises(ConfigError, match="--num-scheduler-steps: .*asynchronous scheduling"):
        LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, num_scheduler_steps=2, async_scheduling=False)
    with pytest.raises(ConfigError, match="--num-scheduler-steps: speculative"):
        LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, num_scheduler_steps=2,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_num_scheduler_steps_needs_sample_async(model_dir):
    with pytest.raises(ConfigError, match="--num-scheduler-steps 4: .* no sample_async"):
        LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, num_scheduler_steps=4)


def _decoding(outputs: int, prompt: int = 5, **params) -> ScheduledSeq:
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=list(range(prompt)),
                   params=SamplingParams(**params), seed=0, arrival=0, output_token_ids=[1] * outputs,
                   max_tokens=params.get("max_tokens") or 16)
    seq.num_computed = prompt + outputs - 1
    return ScheduledSeq(seq, 1)


def test_round_steps():
    assert rounds.round_steps([_decoding(3, max_tokens=40)], 8, 1000) == 8
    assert rounds.round_steps([_decoding(3, max_tokens=40)], 1, 1000) == 1
    # max_model_len: step j computes position prompt + outputs - 1 + j, which stays below it
    assert rounds.round_steps([_decoding(3, max_tokens=40)], 8, 12) == 5
    # no step after every sequence's last token; the longest one sets it
    assert rounds.round_steps([_decoding(3, max_tokens=5), _decoding(3, max_tokens=6)], 8, 1000) == 3
    assert rounds.round_steps([_decoding(3, max_tokens=40, min_tokens=4)], 8, 1000) == 1
    assert rounds.round_steps([_decoding(3, max_tokens=40, min_tokens=3)], 8, 1000) == 8
    prefill = _decoding(3, max_tokens=40)
    prefill.seq.num_computed -= 2
    assert rounds.round_steps([prefill], 8, 1000) == 1
    history = _decoding(3, max_tokens=40)
    history.seq.reads_history = True
    assert rounds.round_steps([history], 8, 1000) == 1


def test_later_inputs_are_the_steps_they_stand_for():
    """Round step j's positions and slots equal those prepare_inputs gives the sequences j
    tokens later, across a block boundary."""
    seqs = [_decoding(n, prompt=p, max_tokens=40) for n, p in ((3, 5), (1, 14), (6, 2))]
    for s, table in zip(seqs, ([4, 9, 2], [7, 3, 8, 5, 11], [6, 1, 10])):
        s.seq.block_table = table
    first, _ = prepare_inputs(seqs, 4)
    for j in range(1, 4):
        for s in seqs:
            s.seq.output_token_ids.append(PLACEHOLDER)
            s.seq.num_computed += 1
        want, _ = prepare_inputs(seqs, 4)
        got = rounds.later_inputs(first, j, 4)
        np.testing.assert_array_equal(got.positions, want.positions)
        np.testing.assert_array_equal(got.meta.slot_mapping, want.meta.slot_mapping)
        np.testing.assert_array_equal(got.meta.seq_lens, want.meta.seq_lens)
        np.testing.assert_array_equal(got.logit_rows, want.logit_rows)
        assert (got.input_ids == PLACEHOLDER).all()
