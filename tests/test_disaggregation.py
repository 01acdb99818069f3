"""Prefill/decode disaggregation inside the engine: a request prefilled by one engine core
(``hand_over``), its prompt's keys and values exported as host arrays, continued by another
(``Prefilled``), gives the tokens one engine gives, and the second computes no prompt token.
On a tiny random-weight Llama, both runtimes of the CPU backend, with the prefix cache, chunked
prefill and a quantized KV cache on the way."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.core import Prefilled  # noqa: E402
from fd_core.errors import ConfigError  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.redis_server import redis_server  # noqa: E402, F401
from tests.test_kv_cache import shared_prefix_prompts  # noqa: E402

BLOCK = 4
MAX_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12, ignore_eos=True)  # no seed: the core draws one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("disaggregation"))


def engine(model_dir, **args):
    return LLM(model=str(model_dir), max_model_len=MAX_LEN, block_size=BLOCK, num_kv_blocks=256, **args).engine.core


def disaggregated(prefill, decode, prompts, params):
    """Each prompt prefilled by ``prefill`` and decoded by ``decode``; the tokens, by request."""
    tokens = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params, hand_over=True)
    handed = 0
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
            assert out.finish_reason is None  # no request ends on the prefill side here
        for seq in prefill.prefilled():
            kv = prefill.export_kv(seq)
            prefill.release(seq)
            decode.add_request(seq.request_id, seq.prompt_token_ids, seq.params,
                               prefilled=Prefilled(seq.output_token_ids[0], seq.seed, kv, seq.num_cached_tokens))
            handed += 1
    assert handed == len(prompts)
    assert prefill.pool.num_free == prefill.pool.capacity  # every block of a handed-over request is back
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id].append(out.token_id)
    assert decode.pool.num_free == decode.pool.capacity
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def alone(core, prompts, params):
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    tokens = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("runtime", ["paddle", "torch"])
def test_handed_over_requests_decode_as_on_one_engine(model_dir, runtime):
    prompts = shared_prefix_prompts(12)
    reference = alone(engine(model_dir, runtime=runtime), prompts, GREEDY)
    # the prefill side in small chunks, so prompts span several steps; both with prefix caching
    prefill = engine(model_dir, runtime=runtime, async_scheduling=False, max_num_batched_tokens=8)
    decode = engine(model_dir, runtime=runtime)
    assert disaggregated(prefill, decode, prompts, GREEDY) == reference
    assert decode.stats["prompt_tokens_computed"] == 0 and decode.stats["prompt_tokens"] == 0
    assert prefill.stats["prompt_tokens_computed"] > 0
    assert decode.stats["generation_tokens"] == len(prompts) * (GREEDY.max_tokens - 1)
    # the decode side's prefix cache learnt the transferred prompts: the same again hits it
    before = decode.pool.num_cached
    assert disaggregated(prefill, decode, prompts, GREEDY) == reference
    assert decode.pool.num_cached == before and decode.stats["prompt_tokens_computed"] == 0


def test_sampled_requests_keep_their_seed_across_the_hand_over(model_dir):
    prompts = shared_prefix_prompts(6)
    prefill = engine(model_dir, async_scheduling=False, seed=5)
    reference = engine(model_dir, seed=5)
    # the same engine seed draws the same per-request seeds in both, in the same order
    assert disaggregated(prefill, engine(model_dir), prompts, SEEDED) == alone(reference, prompts, SEEDED)


def test_a_quantized_kv_cache_moves_whole(model_dir):
    prompts = shared_prefix_prompts(6)
    args = dict(runtime="torch", kv_cache_dtype="int8")
    reference = alone(engine(model_dir, **args), prompts, GREEDY)
    assert disaggregated(engine(model_dir, async_scheduling=False, **args), engine(model_dir, **args),
                         prompts, GREEDY) == reference


def test_requests_that_end_on_their_first_token_or_have_n_outputs_stay(model_dir):
    prefill = engine(model_dir, async_scheduling=False)
    prefill.add_request("one", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1), hand_over=True)
    prefill.add_request("two", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, n=2), hand_over=True)
    counts = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + 1
        assert prefill.prefilled() == []
    assert counts == {"one": 1, "two": 6}


def test_an_aborted_prefilled_request_frees_its_blocks(model_dir):
    prefill = engine(model_dir, async_scheduling=False)
    prefill.add_request("r", list(range(3, 30)), GREEDY, hand_over=True)
    while not prefill.prefilled():
        prefill.step()
    prefill.abort("r")
    assert prefill.pool.num_free == prefill.pool.capacity and not prefill.has_unfinished_requests()


def test_hand_over_needs_synchronous_scheduling(model_dir):
    core = engine(model_dir)
    core.async_scheduling = True  # as on a backend with sample_async (the CPU has none)
    with pytest.raises(ConfigError, match="async-scheduling"):
        core.add_request("r", [5, 6, 7], GREEDY, hand_over=True)


# -- the cluster's side (fd_core.cluster.disaggregation), in one process with a real Redis -----

def _cluster(redis_server, role, protocol="tcp"):
    from fd_core.cluster.config import SchedulerConfig

    return SchedulerConfig(name="splitwise", role=role, port=redis_server.port, topic="pd", ttl=30,
                           cache_transfer_protocol=protocol).started()


def _drive(core, inbox, until, seconds=20.0):
    """Step ``core`` with its inbox until ``until()`` holds."""
    import time

    deadline = time.monotonic() + seconds
    while not until():
        assert time.monotonic() < deadline, "timed out"
        inbox.poll(core)
        if core.has_unfinished_requests():
            inbox.publish(core, [_wire(o) for o in core.step()])
        else:
            time.sleep(0.01)


def _wire(o):
    from fd_core.engine.core_process import _wire as wire

    return wire(o)


def _results(client):
    import msgspec

    from fd_core.engine.wire import CoreMessage

    decoder = msgspec.msgpack.Decoder(CoreMessage)
    return [decoder.decode(raw) for raw in client.results("front", timeout=0.1)]


def _submit(client, instance, request_id, prompt, params):
    import msgspec

    from fd_core.engine.wire import AddRequest, params_to_wire

    msg = AddRequest(request_id, prompt, params_to_wire(params))
    client.submit(instance, "front", request_id, msgspec.msgpack.encode(msg), len(prompt))


@pytest.mark.parametrize("protocol", ["tcp", "nixl"])
def test_a_prefill_and_a_decode_instance_through_redis(model_dir, redis_server, protocol):
    pytest.importorskip("redis")
    if protocol == "nixl":
        from fd_core.cluster.nixl_transfer import nixl_api

        try:
            nixl_api()
        except ConfigError as exc:
            pytest.skip(str(exc))
    from fd_core.cluster.global_scheduler import GlobalScheduler, RedisAddress, connect
    from fd_core.cluster.instance import ClusterInbox
    from fd_core.engine.wire import StepOutputs

    prompts = shared_prefix_prompts(4)
    reference = alone(engine(model_dir), prompts, GREEDY)
    p_config, d_config = _cluster(redis_server, "prefill", protocol), _cluster(redis_server, "decode", protocol)
    prefill, decode = engine(model_dir, async_scheduling=False), engine(model_dir)
    p_inbox, d_inbox = ClusterInbox(p_config, 4, prefill), ClusterInbox(d_config, 4, decode)
    client = GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="pd")
    try:
        _drive(decode, d_inbox, lambda: d_config.instance_id in client.live())  # it reports its endpoint
        assert client.live()[d_config.instance_id].kv_endpoint.startswith("tcp://127.0.0.1:")
        for i, prompt in enumerate(prompts):
            _submit(client, p_config.instance_id, f"r{i}", prompt, GREEDY)
        tokens, done = {}, set()

        def collect():
            for msg in _results(client):
                assert isinstance(msg, StepOutputs), msg
                for o in msg.outputs:
                    tokens.setdefault(o.request_id, []).append(o.token_id)
                    if o.finish_reason:
                        done.add(o.request_id)
            return len(done) == len(prompts)

        # the decode instance's connector receives on its own thread, its engine waits meanwhile
        _drive(prefill, p_inbox, lambda: p_inbox.transfer_stats.requests == len(prompts))
        _drive(decode, d_inbox, collect)
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
        assert p_inbox.transfer_stats.requests == d_inbox.transfer_stats.requests == len(prompts)
        assert decode.stats["prompt_tokens_computed"] == 0
        assert client.client.hlen("fd:pd:owner") == 0 and client.client.hlen("fd:pd:req") == 0  # nothing left behind
    finally:
        p_inbox.leave()
        d_inbox.leave()


def test_a_kv_cache_no_decode_instance_takes_ends_its_request_with_the_reason(model_dir, redis_server, monkeypatch):
    pytest.importorskip("redis")
    from fd_core.cluster import disaggregation
    from fd_core.cluster.global_scheduler import GlobalScheduler, Load, RedisAddress, connect
    from fd_core.cluster.instance import ClusterInbox
    from fd_core.engine.wire import Failed, StepOutputs
    from tests.redis_server import free_port

    monkeypatch.setattr(disaggregation, "TRANSFER_TIMEOUT_S", 0.5)
    config = _cluster(redis_server, "prefill")
    prefill = engine(model_dir, async_scheduling=False)
    inbox = ClusterInbox(config, 4, prefill)
    client = GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="pd")
    try:
        got = []

        def failed():
            got.extend(_results(client))
            return any(isinstance(m, Failed) for m in got)

        _submit(client, config.instance_id, "alone", [5, 6, 7, 8], GREEDY)  # no decode instance at all
        _drive(prefill, inbox, failed)
        first, failure = got
        assert isinstance(first, StepOutputs) and len(first.outputs) == 1  # the first token went out
        assert isinstance(failure, Failed) and "no live decode instance" in failure.message

        # one that registered and does not answer (a dead endpoint): one try, then the error
        ghost = GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="pd", instance="ghost",
                                role="decode")
        ghost.heartbeat(Load(capacity=4, kv_endpoint=f"tcp://127.0.0.1:{free_port()}",
                             kv_layout=disaggregation.kv_layout(prefill)))
        _submit(client, config.instance_id, "lost", [5, 6, 7, 8], GREEDY)
        got.clear()
        _drive(prefill, inbox, failed, seconds=10)
        results = got
        assert inbox.transfer_stats.failures == 1
        assert isinstance(results[-1], Failed) and results[-1].request_id == "lost"
        assert "could not be sent to a decode instance (ghost)" in results[-1].message
        assert prefill.pool.num_free == prefill.pool.capacity
        assert client.client.hlen("fd:pd:owner") == 0 and client.client.scard("fd:pd:running:ghost") == 0
    finally:
        inbox.leave()


def test_roles_are_checked_at_start_up():
    from fd_core.cluster.config import SchedulerConfig
    from fd_core.cluster.disaggregation import configure_engine
    from fd_core.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="--scheduler-name splitwise"):
        SchedulerConfig(name="global", role="prefill")
    with pytest.raises(ConfigError, match="--pd-comm-port"):
        SchedulerConfig(name="splitwise", role="decode", pd_comm_port=70000)
    prefill = SchedulerConfig(name="splitwise", role="prefill")
    assert prefill.is_global
    assert configure_engine(EngineConfig(model="m"), prefill).async_scheduling is False
    with pytest.raises(ConfigError, match="--async-scheduling"):
        configure_engine(EngineConfig(model="m", async_scheduling=True), prefill)
    draft = EngineConfig(model="m", speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="speculative decoding"):
        configure_engine(draft, SchedulerConfig(name="splitwise", role="decode"))


def test_an_unknown_connector_is_named():
    from fd_core.plugins import get_registry

    with pytest.raises(ConfigError, match="--cache-transfer-protocol rdma: no such KV-cache connector is installed "
                                          r"\(installed: tcp, nixl\)"):
        get_registry().kv_transfer("rdma")
