"""The engine core's side of the global scheduler (``fd_core/cluster/instance.py``) against a real
``redis-server``, with a stand-in for the engine core: what it pulls and when, where outputs
and failures go, aborts, a clean stop, and Redis going away under it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

pytest.importorskip("redis")

from fd_core.cluster.config import SchedulerConfig  # noqa: E402
from fd_core.cluster.global_scheduler import GlobalScheduler, RedisAddress, connect  # noqa: E402
from fd_core.cluster.instance import ClusterInbox, abort_key  # noqa: E402
from fd_core.engine.wire import AddRequest, CoreMessage, Failed, StepOutputs, WireOutput  # noqa: E402


class FakeCore:
    """What ClusterInbox touches of an EngineCore: requests in, aborts, the queues' sizes."""

    def __init__(self) -> None:
        self.seqs: dict[str, list] = {}
        self.scheduler = SimpleNamespace(running=[], waiting=[])
        self.pool = SimpleNamespace(num_free=10, capacity=10)
        self.aborted: list[tuple[str, int | None]] = []

    def add_request(self, request_id, token_ids, params, cache_salt=None, hand_over=False) -> None:
        if params.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1")
        self.seqs[request_id] = [token_ids]
        self.scheduler.waiting.append(request_id)

    def abort(self, request_id, index=None) -> None:
        self.aborted.append((request_id, index))
        if index is None:
            self.seqs.pop(request_id, None)

    def finish(self, request_id) -> None:
        self.seqs.pop(request_id)
        self.scheduler.waiting.remove(request_id)


def setup(server, capacity=2):
    config = SchedulerConfig(name="global", port=server.port, topic="t", ttl=5).started()
    inbox = ClusterInbox(config, capacity)
    client = GlobalScheduler(connect(RedisAddress(port=server.port)), topic="t")
    return inbox, client, config.instance_id


def submit(client, instance, request_id, max_tokens=4) -> None:
    msg = AddRequest(request_id, [1, 2, 3], {"max_tokens": max_tokens})
    client.submit(instance, "front", request_id, msgspec.msgpack.encode(msg), 3)


def received(client) -> list:
    decoder = msgspec.msgpack.Decoder(CoreMessage)
    return [decoder.decode(raw) for raw in client.results("front", timeout=1)]


def output(request_id, token, finish=None) -> WireOutput:
    return WireOutput(request_id, 0, [token], -0.1, [], [], [], finish, None)


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_requests_are_pulled_while_there_is_room_and_outputs_reach_their_submitter(redis_server):
    inbox, client, me = setup(redis_server)
    core = FakeCore()
    for i in range(3):
        submit(client, me, f"r{i}")
    assert inbox.poll(core) == 2  # capacity 2
    assert sorted(core.seqs) == ["r0", "r1"]
    assert inbox.poll(core) == 0  # no room
    assert wait_for(lambda: client.live()[me].waiting == 2, 2 * inbox.heartbeat_s + 1)  # the next report says so
    inbox.publish(core, [output("r0", 7), output("r1", 8)])
    core.finish("r0")
    inbox.publish(core, [output("r0", 9, "length")])
    (first, second) = received(client)
    assert isinstance(first, StepOutputs) and [o.token_ids for o in first.outputs] == [[7], [8]]
    assert [(o.token_ids, o.finish_reason) for o in second.outputs] == [([9], "length")]
    assert client.client.hget("fd:t:req", "r0") is None  # finished: forgotten in Redis
    assert inbox.served == 1
    assert inbox.poll(core) == 1 and "r2" in core.seqs  # r0's room


def test_a_request_the_engine_refuses_fails_to_its_submitter_alone(redis_server):
    inbox, client, me = setup(redis_server)
    core = FakeCore()
    submit(client, me, "bad", max_tokens=0)
    submit(client, me, "good")
    inbox.poll(core)
    assert list(core.seqs) == ["good"]
    (failure,) = received(client)
    assert isinstance(failure, Failed) and failure.request_id == "bad" and "max_tokens" in failure.message


def test_aborts_reach_the_engine(redis_server):
    inbox, client, me = setup(redis_server)
    core = FakeCore()
    submit(client, me, "r0")
    inbox.poll(core)
    assert client.abort("r0", abort_key("r0", 1)) == "running"  # one sequence
    assert client.abort("r0") == "running"  # the whole request
    inbox.poll(core)
    assert core.aborted == [("r0", 1), ("r0", None)]
    assert client.client.hget("fd:t:owner", "r0") is None  # gone from the engine: forgotten


def test_a_clean_stop_ends_what_the_engine_holds_and_hands_the_queue_on(redis_server):
    inbox, client, me = setup(redis_server, capacity=1)
    other = GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="t", instance="other")
    from fd_core.cluster.global_scheduler import Load

    other.heartbeat(Load(capacity=4))
    core = FakeCore()
    submit(client, me, "held")
    submit(client, me, "queued")
    inbox.poll(core)
    inbox.leave()
    (failure,) = received(client)
    assert isinstance(failure, Failed) and failure.request_id == "held" and "was stopped" in failure.message
    assert [p.request_id for p in other.pull(4, steal=False)] == ["queued"]
    assert me not in client.live()


def test_redis_going_away_does_not_stop_the_engine(redis_server):
    inbox, client, me = setup(redis_server)
    core = FakeCore()
    submit(client, me, "r0")
    inbox.poll(core)
    redis_server.stop()
    started = time.monotonic()
    assert inbox.poll(core) == 0  # logged, not raised
    inbox.publish(core, [output("r0", 5)])  # kept
    assert inbox.poll(core) == 0  # and not retried before the next heartbeat
    assert time.monotonic() - started < 2
    redis_server.start()
    time.sleep(inbox.heartbeat_s)
    inbox.poll(core)
    (batch,) = received(client)
    assert [o.token_ids for o in batch.outputs] == [[5]]


def test_a_step_longer_than_the_ttl_keeps_the_instance_live_and_a_hung_loop_does_not(redis_server, monkeypatch):
    """The load is reported by a thread of its own: an engine loop away for three TTLs (one long
    step) is still live to the cluster; one away for STALL_S (hung) is not, so that it is reaped."""
    from fd_core.cluster import heartbeat

    config = SchedulerConfig(name="global", port=redis_server.port, topic="t", ttl=1).started()
    inbox = ClusterInbox(config, 2)
    client = GlobalScheduler(connect(RedisAddress(port=redis_server.port)), topic="t")
    core = FakeCore()
    inbox.poll(core)
    time.sleep(3 * config.ttl)  # the step; no poll meanwhile
    assert config.instance_id in client.live()
    monkeypatch.setattr(heartbeat, "STALL_S", 0.5)
    assert wait_for(lambda: config.instance_id not in client.live(), 0.5 + 2 * config.ttl)
    inbox.poll(core)  # back: reported again
    assert wait_for(lambda: config.instance_id in client.live(), 2)
    inbox.leave()
    time.sleep(2 * inbox.heartbeat_s)
    assert config.instance_id not in client.live()  # a clean stop stops the reports
