"""Asynchronous scheduling (``sample_async``): the engine queues step t+1 before it reads step
t's tokens. On the CPU no op is asynchronous, so the cpu backend leaves ``sample_async`` out;
here a test registers one (the Paddle reference's sample, handed back as a PendingSample whose
``feed`` scatters on the host) and every scheduling path must give what the synchronous engine
gives: tokens, logprobs, finish reasons, and a clean block pool."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.model_runner import PLACEHOLDER  # noqa: E402
from fd_core.errors import ConfigError  # noqa: E402
from fd_core.testing import spec  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.plugins.host_fed import HostFed, async_cpu_registry  # noqa: E402


@pytest.fixture()
def async_cpu(monkeypatch):
    """The process registry with a ``sample_async`` for the cpu device."""
    return async_cpu_registry(monkeypatch)


class HostGate(spec.HostBitmask):
    """The specification's ``DeferredBitmask``, counting how many the engine made."""

    made = 0

    def __init__(self, rows: int, words: int) -> None:
        super().__init__(rows, words)
        HostGate.made += 1


class LateSample(HostFed):
    """``sample_async`` as a device runs it: the sample is drawn when its tokens are first asked
    for, after its deferred bitmask's ``ready()`` (the specification's ``SampledLate``)."""

    def __init__(self, sample, logits, batch) -> None:
        self.late = spec.SampledLate(logits, batch, sample)

    @property
    def output(self):
        return self.late.output

    def result(self):
        return self.late.output


@pytest.fixture()
def deferred_cpu(async_cpu, monkeypatch):
    """``async_cpu`` with the ``deferred_bitmask`` op, its sample run late (``LateSample``); every
    step with a constrained row defers its masks (``DEFER_ROWS``)."""
    from fd_core.engine import core

    monkeypatch.setattr(core, "DEFER_ROWS", 1)
    from fd_core.runtimes.paddle.ops import REFERENCE_OPS

    sample = REFERENCE_OPS["sample"]
    async_cpu.ops.register("sample_async", "cpu", lambda logits, batch: LateSample(sample, logits, batch),
                           name="late", runtime="paddle", priority=1)
    async_cpu.ops.register("deferred_bitmask", "cpu", HostGate, name="host-gate", runtime="paddle")
    HostGate.made = 0
    return async_cpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("async"))


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 400, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def generate(model_dir, params, prompt_list=None, **engine_args):
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, **engine_args)
    outs = llm.generate(prompt_list or prompts(12), params, use_tqdm=False)
    pool = llm.engine.pool
    assert pool.num_free == pool.capacity  # every block came back
    assert not llm.engine.core.has_unfinished_requests()
    return llm, [[(c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in o.outputs]
                 for o in outs]


def compare(model_dir, params, prompt_list=None, fed=True, **engine_args):
    """The outputs of both engines (equal) and their step counts. ``fed``: whether some step's
    input tokens came from the device (False: every step's tokens had to be read first)."""
    reference, sync = generate(model_dir, params, prompt_list, async_scheduling=False, **engine_args)
    before = HostFed.fed
    llm, overlapped = generate(model_dir, params, prompt_list, **engine_args)
    assert llm.engine.core.async_scheduling and (HostFed.fed > before) == fed
    # a sequence that stopped still fills a row of the step queued after its last token, so
    # the batches differ and the float32 sums may round differently
    assert [[c[:3] for c in o] for o in overlapped] == [[c[:3] for c in o] for o in sync]
    np.testing.assert_allclose([c[3] for o in overlapped for c in o], [c[3] for o in sync for c in o], rtol=1e-5)
    return sync, (reference.engine.stats["steps"], llm.engine.stats["steps"])


SETTINGS = {
    "plain": {"num_kv_blocks": 512},
    "chunked": {"num_kv_blocks": 512, "max_num_batched_tokens": 7},  # decodes mixed with chunks
    "preempt-recompute": {"num_kv_blocks": 4 * 15 + 1},
    "preempt-swap": {"num_kv_blocks": 4 * 15 + 1, "swap_space": 0.01},
    # the budget of the CPU backend when this was written: at 48 a sequence whose last token is in
    # flight holds its seat a step longer, which delays the next admission on this workload
    "few-seqs": {"num_kv_blocks": 512, "max_num_seqs": 3, "max_num_batched_tokens": 256},
    "capped": {"num_kv_blocks": 512, "max_num_batched_tokens": 16, "long_prefill_token_threshold": 4},
}


# a greedy and a seeded batch, each row sampling as the synchronous engine's would
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=17, ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
def test_async_scheduling_gives_the_synchronous_outputs(async_cpu, model_dir, setting, params):
    _, (sync_steps, async_steps) = compare(model_dir, params, **SETTINGS[setting])
    if "preempt" not in setting:
        # a sequence whose last token is in flight is not scheduled again: no step is wasted
        # (under preemption the schedules may differ: it holds its blocks one step longer)
        assert async_steps == sync_steps


@pytest.mark.parametrize("setting", ["chunked", "preempt-recompute"])
def test_prompt_logprobs_are_those_of_the_synchronous_engine(async_cpu, model_dir, setting):
    """A step's prompt scores come back when it is queued, before the first token they go with
    is read; prompt chunks beside decodes fed from the device, and preemptions, change nothing."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2)
    results = []
    for async_scheduling in (False, True):
        llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, async_scheduling=async_scheduling,
                  **SETTINGS[setting])
        results.append(llm.generate(prompts(12), params, use_tqdm=False))
        assert llm.engine.core.async_scheduling == async_scheduling
        assert llm.engine.pool.num_free == llm.engine.pool.capacity
    assert HostFed.fed > 0
    for sync, overlapped in zip(*results):
        assert overlapped.outputs[0].token_ids == sync.outputs[0].token_ids
        assert len(overlapped.prompt_logprobs) == len(sync.prompt_logprobs) == len(sync.prompt_token_ids)
        for a, b in zip(sync.prompt_logprobs[1:], overlapped.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and [x.rank for x in a.values()] == [x.rank for x in b.values()]
            np.testing.assert_allclose([x.logprob for x in b.values()], [x.logprob for x in a.values()], rtol=1e-5)


def test_stops_mid_flight_drop_the_extra_token(async_cpu, model_dir):
    """A stop id ends a sequence on a token read one step late: the step already queued for it
    is wasted, its token never shows, and its blocks are freed."""
    _, sync = generate(model_dir, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       async_scheduling=False, num_kv_blocks=512)
    stop_ids = sorted({out[0][0][4] for out in sync})[:4]  # fifth tokens of some prompts
    params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=stop_ids, min_tokens=2)
    result, _ = compare(model_dir, params, num_kv_blocks=512)
    assert sum(out[0][1] == "stop" for out in result) >= 2
    assert all(PLACEHOLDER not in out[0][0] for out in result)


def test_forks_and_penalties_read_the_tokens_first(async_cpu, model_dir):
    compare(model_dir, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
            prompts(4), num_kv_blocks=512)
    # penalties read every output token so far: no step is queued before the last is read
    compare(model_dir, SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True,
                                      presence_penalty=0.5, repetition_penalty=1.3),
            prompts(6), fed=False, num_kv_blocks=512)
    # beside other requests: a penalised sequence that starts sampling in a step whose other
    # rows take their tokens from the device must not read theirs (they are placeholders)
    compare(model_dir, MIXED * 2, prompts(10), num_kv_blocks=512)


MIXED = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=13, ignore_eos=True, logprobs=2),
    SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=2, max_tokens=10, ignore_eos=True, presence_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
]


def test_forks_past_max_num_seqs(async_cpu, model_dir):
    """Forks seated within max_num_seqs (their first tokens read from the parent's row) and
    forks detached to compute the prompt themselves, beside capped prefills."""
    compare(model_dir, SamplingParams(n=5, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True),
            prompts(6), num_kv_blocks=512, max_num_seqs=3, max_num_batched_tokens=16,
            long_prefill_token_threshold=5)


@pytest.mark.parametrize("steps", [1, 4], ids=["steps", "rounds"])
def test_stop_strings_and_aborts(async_cpu, model_dir, steps):
    """The front end aborts a request whose text hit a stop string; an abort between steps
    drops a token in flight (with ``num_scheduler_steps``, a round's). Neither may leak a block
    or a placeholder."""
    llm = LLM(model=str(model_dir), max_model_len=128, block_size=4, num_kv_blocks=512, num_scheduler_steps=steps)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)  # not a multiple of a round
    for i, p in enumerate(prompts(5)):
        engine.add_request(f"r{i}", p, params)
    for _ in range(4):
        engine.step()
    seq = engine.core.seqs["r1"][0]
    engine.abort_request("r1")
    assert PLACEHOLDER not in seq.output_token_ids
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert set(finished) == {"r0", "r2", "r3", "r4"}
    assert all(len(o.outputs[0].token_ids) == 41 for o in finished.values())
    assert engine.pool.num_free == engine.pool.capacity
    assert (engine.stats["rounds"] > 0) == (steps > 1)


def test_async_scheduling_refused_where_impossible(model_dir):
    with pytest.raises(ConfigError, match="no sample_async"):
        LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64, async_scheduling=True)
    llm = LLM(model=str(model_dir), max_model_len=128, num_kv_blocks=64)
    assert not llm.engine.core.async_scheduling  # the cpu backend has no sample_async
