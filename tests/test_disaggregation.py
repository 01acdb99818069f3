"""Prefill/decode disaggregation inside the engine: a request prefilled by one engine core
(``hand_over``), its prompt's keys and values exported as host arrays, continued by another
(``Prefilled``), gives the tokens one engine gives, and the second computes no prompt token.
On a tiny random-weight Llama, both runtimes of the CPU backend, with the prefix cache, chunked
prefill and a quantized KV cache on the way."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.core import Prefilled  # noqa: E402
from fd_core.errors import ConfigError  # noqa: E402
from tests import checkpoints  # noqa: E402
from tests.test_kv_cache import shared_prefix_prompts  # noqa: E402
from tests.test_kv_transfer import connector  # noqa: E402

BLOCK = 4
MAX_LEN = 128
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12, ignore_eos=True)  # no seed: the core draws one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return checkpoints.make_llama(tmp_path_factory.mktemp("disaggregation"))


def engine(model_dir, **args):
    args = {"num_kv_blocks": 256, **args}
    return LLM(model=str(model_dir), max_model_len=MAX_LEN, block_size=BLOCK, **args).engine.core


def disaggregated(prefill, decode, prompts, params, on_device=False):
    """Each prompt prefilled by ``prefill`` and decoded by ``decode``; the tokens, by request.
    ``on_device``: the blocks move as the Memory's tensors (a device connector's path)."""
    tokens = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params, hand_over=True)
    handed = 0
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            assert out.finish_reason is None  # no request ends on the prefill side here
        for seq in prefill.prefilled():
            kv = prefill.export_kv(seq, on_device)
            prefill.release(seq)  # its blocks may be reused at once: the export is a copy
            decode.add_request(seq.request_id, seq.prompt_token_ids, seq.params,
                               prefilled=Prefilled(seq.output_token_ids[0], seq.seed, kv, seq.num_cached_tokens))
            handed += 1
    assert handed == len(prompts)
    assert prefill.pool.num_free == prefill.pool.capacity  # every block of a handed-over request is back
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens[out.request_id].extend(out.token_ids)
    assert decode.pool.num_free == decode.pool.capacity
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def alone(core, prompts, params):
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    tokens = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
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


def test_a_handed_over_request_preempted_on_the_decode_side_recomputes_and_gives_the_same_tokens(model_dir):
    """Too few blocks on the decode side for every transferred request to grow: some are
    preempted (by recompute: their transferred blocks are gone) and compute their prompt and
    tokens there; the tokens are one engine's all the same."""
    prompts = shared_prefix_prompts(12)
    reference = alone(engine(model_dir), prompts, GREEDY)
    decode = engine(model_dir, num_kv_blocks=40, enable_prefix_caching=False)
    assert disaggregated(engine(model_dir, async_scheduling=False), decode, prompts, GREEDY) == reference
    assert decode.stats["preemptions"] > 0 and decode.stats["prompt_tokens_computed"] > 0


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


def test_a_bfloat16_cache_travels_as_its_bits(model_dir):
    """Half the bytes of the float32 it was once widened to, and the same tokens as one engine
    (torch: Paddle's CPU backend runs float32 only; its Memory's bits are in test_paddle_memory)."""
    prompts = shared_prefix_prompts(4)
    args = dict(runtime="torch", dtype="bfloat16")
    reference = alone(engine(model_dir, **args), prompts, GREEDY)
    prefill = engine(model_dir, async_scheduling=False, **args)
    prefill.add_request("probe", prompts[0], GREEDY, hand_over=True)
    while not prefill.prefilled():
        prefill.step()
    (seq,) = prefill.prefilled()
    (arrays,) = prefill.export_kv(seq)  # one rank
    prefill.release(seq)
    blocks = -(-len(prompts[0]) // BLOCK)
    heads, head_dim = prefill.model_config.num_key_value_heads, prefill.model_config.head_dim
    assert all(a.dtype == np.uint16 and a.shape == (blocks * BLOCK, heads, head_dim) for a in arrays)
    assert disaggregated(prefill, engine(model_dir, **args), prompts, GREEDY) == reference


@pytest.mark.parametrize("runtime,args", [("paddle", {}), ("torch", {"dtype": "bfloat16"}),
                                          ("torch", {"kv_cache_dtype": "int8"})])
def test_blocks_exported_as_device_tensors_decode_as_on_one_engine(model_dir, runtime, args):
    """A device connector's path (API 1.16): the blocks leave as a copy in the Memory's own
    tensors and go into the decode engine's cache as they are, no host array on the way."""
    prompts = shared_prefix_prompts(6)
    reference = alone(engine(model_dir, runtime=runtime, **args), prompts, GREEDY)
    prefill = engine(model_dir, runtime=runtime, async_scheduling=False, **args)
    prefill.add_request("probe", prompts[0], GREEDY, hand_over=True)
    while not prefill.prefilled():
        prefill.step()
    (seq,) = prefill.prefilled()
    (tensors,) = prefill.export_kv(seq, on_device=True)
    host = prefill.export_kv(seq)[0]
    prefill.release(seq)
    memory = prefill.executor.runner.memory
    assert len(tensors) == 2 * prefill.model_config.num_hidden_layers
    assert not any(isinstance(t, np.ndarray) for t in tensors)
    storage = [memory.to_numpy_bits(t) if hasattr(memory, "to_numpy_bits") else memory.to_numpy(t) for t in tensors]
    assert [a.tobytes() for a in storage] == [b.tobytes() for b in host]  # the blocks, as the host path sends them
    assert disaggregated(prefill, engine(model_dir, runtime=runtime, **args), prompts, GREEDY, on_device=True) == reference


def test_a_device_connector_is_checked_at_start_up():
    from types import SimpleNamespace

    from fd_core.cluster.disaggregation import check_transfer

    def core(platform="cpu", ranks=1, kv_swap=True):
        return SimpleNamespace(platform=SimpleNamespace(name=platform), tp=SimpleNamespace(world_size=ranks),
                               capabilities=SimpleNamespace(kv_swap=kv_swap))

    ipc = SimpleNamespace(name="cuda_ipc", device="cuda")
    check_transfer(ipc, core("cuda"), "prefill")
    check_transfer(ipc, core("cuda", kv_swap=False), "decode")  # nothing is staged on the host
    with pytest.raises(ConfigError, match="--role decode: --cache-transfer-protocol cuda_ipc moves cuda device memory; "
                                          "this instance runs on cpu"):
        check_transfer(ipc, core("cpu"), "decode")
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 use a host connector"):
        check_transfer(ipc, core("cuda", ranks=2), "prefill")
    with pytest.raises(ConfigError, match=r"cannot copy KV blocks to host memory \(Capabilities.kv_swap\)"):
        check_transfer(SimpleNamespace(name="tcp"), core(kv_swap=False), "prefill")


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


class TensorTransfer:
    """A device connector for the CPU (API 1.16): the torch runtime's tensors in and out, over
    ``tcp`` as arrays, so the cluster's device path runs here as on cuda_ipc."""

    name, device = "cpu_tensors", "cpu"

    def __init__(self, timeout: float) -> None:
        from fd_core.cluster.tcp_transfer import TcpTransfer

        self.inner = TcpTransfer(timeout)
        self.listen, self.completed, self.close = self.inner.listen, self.inner.completed, self.inner.close

    def send(self, endpoint, request_id, header, arrays):
        import torch

        assert all(isinstance(t, torch.Tensor) for t in arrays), "the engine handed host arrays"
        self.inner.send(endpoint, request_id, header, [t.numpy() for t in arrays])

    def received(self):
        import torch

        got = self.inner.received()
        for item in got:
            item.arrays = [torch.from_numpy(a.copy()) for a in item.arrays]
        return got


@pytest.mark.parametrize("protocol", ["tcp", "nixl", "cpu_tensors"])
def test_a_prefill_and_a_decode_instance_through_redis(model_dir, redis_server, protocol, monkeypatch):
    pytest.importorskip("redis")
    runtime = {}
    if protocol == "cpu_tensors":
        from fd_core.plugins import get_registry

        monkeypatch.setitem(get_registry().transfers, protocol, (TensorTransfer, "tests"))
        runtime = {"runtime": "torch"}  # its Memory's tensors are what the connector takes
    connector(protocol).close()  # skips where it cannot run (nixl without its package)
    from fd_core.cluster.global_scheduler import GlobalScheduler, RedisAddress, connect
    from fd_core.cluster.instance import ClusterInbox
    from fd_core.engine.wire import StepOutputs

    prompts = shared_prefix_prompts(4)
    reference = alone(engine(model_dir, **runtime), prompts, GREEDY)
    p_config, d_config = _cluster(redis_server, "prefill", protocol), _cluster(redis_server, "decode", protocol)
    prefill, decode = engine(model_dir, async_scheduling=False, **runtime), engine(model_dir, **runtime)
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
                    tokens.setdefault(o.request_id, []).extend(o.token_ids)
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


def _prefill_instance(model_dir, redis_server):
    """A prefill engine with its ClusterInbox, and a submitter's view of the cluster."""
    pytest.importorskip("redis")
    from fd_core.cluster.global_scheduler import GlobalScheduler, RedisAddress, connect
    from fd_core.cluster.instance import ClusterInbox

    config = _cluster(redis_server, "prefill")
    prefill = engine(model_dir, async_scheduling=False)
    inbox = ClusterInbox(config, 4, prefill)
    return config, prefill, inbox, GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="pd")


def _decode_report(redis_server, name: str, ttl: float = 10.0, **load):
    """A decode instance's load report in Redis, and nothing behind it."""
    from fd_core.cluster.global_scheduler import GlobalScheduler, Load, RedisAddress, connect

    scheduler = GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="pd", instance=name,
                                role="decode", ttl=ttl)
    scheduler.heartbeat(Load(**{"capacity": 4, **load}))
    return scheduler


def test_a_kv_cache_no_decode_instance_takes_ends_its_request_with_the_reason(model_dir, redis_server, monkeypatch):
    from fd_core.cluster import disaggregation
    from fd_core.engine.wire import Failed, StepOutputs
    from tests.redis_server import free_port

    monkeypatch.setattr(disaggregation, "TRANSFER_TIMEOUT_S", 0.5)
    config, prefill, inbox, client = _prefill_instance(model_dir, redis_server)
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
        _decode_report(redis_server, "ghost", kv_endpoint=f"tcp://127.0.0.1:{free_port()}",
                       kv_layout=disaggregation.kv_layout(prefill))
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


def test_a_decode_instance_that_dies_with_a_request_in_transit_ends_it_once(model_dir, redis_server, monkeypatch):
    """The decode instance a request was handed to stops reporting before it acknowledges the
    transfer: the reaper ends the request with an error naming it, and the send's timeout later
    neither retries it nor fails it a second time."""
    from fd_core.cluster import disaggregation
    from fd_core.engine.wire import Failed, StepOutputs
    from tests.redis_server import free_port

    monkeypatch.setattr(disaggregation, "TRANSFER_TIMEOUT_S", 3.0)
    config, prefill, inbox, client = _prefill_instance(model_dir, redis_server)
    _decode_report(redis_server, "dying", ttl=1, kv_endpoint=f"tcp://127.0.0.1:{free_port()}",  # nothing answers
                   kv_layout=disaggregation.kv_layout(prefill))
    try:
        got = []

        def sent_and_timed_out():
            got.extend(_results(client))
            return inbox.transfer_stats.failures == 1

        _submit(client, config.instance_id, "r0", [5, 6, 7, 8], GREEDY)
        _drive(prefill, inbox, sent_and_timed_out, seconds=20)
        import time

        until = time.monotonic() + 1.5  # whatever else would come
        while time.monotonic() < until:
            inbox.poll(prefill)
            got.extend(_results(client))
        assert isinstance(got[0], StepOutputs) and len(got[0].outputs) == 1  # the first token
        failures = [m for m in got if isinstance(m, Failed)]
        assert len(got) == 2 and len(failures) == 1, got
        assert "the instance dying running this request stopped reporting" in failures[0].message
        assert prefill.pool.num_free == prefill.pool.capacity
        assert client.client.hlen("fd:pd:owner") == 0 and client.client.hlen("fd:pd:req") == 0
    finally:
        inbox.leave()


def test_a_prefill_instance_pulls_nothing_while_every_decode_instance_is_backlogged(model_dir, redis_server,
                                                                                   monkeypatch):
    """Two sequences per slot on the only decode instance of its layout: no new request is
    prefilled (its KV cache would only wait there); room there again, and it is."""
    from fd_core.cluster import disaggregation

    monkeypatch.setattr(disaggregation, "BACKLOG_CHECK_S", 0.0)
    config, prefill, inbox, client = _prefill_instance(model_dir, redis_server)
    layout = disaggregation.kv_layout(prefill)
    try:
        busy = _decode_report(redis_server, "busy", running=4, waiting=4, kv_endpoint="tcp://127.0.0.1:1",
                              kv_layout=layout)
        _decode_report(redis_server, "idle-other", kv_endpoint="tcp://127.0.0.1:2", kv_layout=layout + "-other")
        _submit(client, config.instance_id, "r0", [5, 6, 7, 8], GREEDY)
        assert inbox.poll(prefill) == 0 and "r0" not in prefill.seqs  # the idle one is not of its layout
        from fd_core.cluster.global_scheduler import Load

        busy.heartbeat(Load(running=4, waiting=3, capacity=4, kv_endpoint="tcp://127.0.0.1:1", kv_layout=layout))
        assert inbox.poll(prefill) == 1 and "r0" in prefill.seqs
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
    with pytest.raises(ConfigError, match="--role prefill: --num-scheduler-steps .* a prefill instance decodes none"):
        configure_engine(EngineConfig(model="m", num_scheduler_steps=4), prefill)
    draft = EngineConfig(model="m", speculative_config={"method": "draft_model", "model": "d", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"speculative decoding with a model of its own \(draft_model\)"):
        configure_engine(draft, SchedulerConfig(name="splitwise", role="decode"))
    ngram = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 3}')
    assert configure_engine(ngram, SchedulerConfig(name="splitwise", role="decode")) is ngram  # the flag's JSON text


def test_an_unknown_connector_is_named():
    from fd_core.plugins import get_registry

    with pytest.raises(ConfigError, match="--cache-transfer-protocol rdma: no such KV-cache connector is installed "
                                          r"\(installed: tcp, nixl[,)]"):  # then what packages add
        get_registry().kv_transfer("rdma")
