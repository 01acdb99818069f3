"""The global scheduler's protocol (``fd_core/cluster/global_scheduler.py``) against a real
``redis-server`` on a loopback port: queues, work stealing, load reports that expire, a dead
instance's requests taken over or ended, aborts, the choice of an instance."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("redis")

from fd_core.cluster.global_scheduler import (  # noqa: E402
    GlobalScheduler,
    Load,
    RedisAddress,
    SchedulerUnavailableError,
    connect,
)
from tests.redis_server import free_port  # noqa: E402


def scheduler(server, instance=None, ttl=10.0, role="mixed", topic="t"):
    return GlobalScheduler(connect(RedisAddress(port=server.port)), topic=topic, instance=instance, ttl=ttl, role=role)


def failure(request_id: str, message: str) -> bytes:
    return f"failed {request_id}: {message}".encode()


def test_requests_flow_from_a_submitter_to_an_instance_and_back(redis_server):
    a = scheduler(redis_server, "a")
    client = scheduler(redis_server)
    a.heartbeat(Load(capacity=4))
    for i in range(3):
        client.submit("a", "front", f"r{i}", f"payload {i}".encode(), prompt_tokens=10 + i)
    first = a.pull(2)
    assert [(p.request_id, p.origin, p.payload, p.prompt_tokens, p.stolen_from) for p in first] == [
        ("r0", "front", b"payload 0", 10, None), ("r1", "front", b"payload 1", 11, None)]
    assert [p.request_id for p in a.pull(5)] == ["r2"]
    assert a.pull(5) == []
    a.publish({"front": [b"outputs 1"]})
    a.publish({"front": [b"outputs 2", b"outputs 3"]})
    assert client.results("front", timeout=1) == [b"outputs 1", b"outputs 2", b"outputs 3"]
    assert client.results("front", timeout=0.1) == []
    a.finish(["r0", "r1", "r2"])
    keys = {k.decode() for k in a.client.keys("fd:t:*")}
    assert keys == {"fd:t:instances", "fd:t:load:a"}  # nothing of the requests is left


def test_an_idle_instance_steals_from_the_tail_of_the_longest_queue(redis_server):
    a, b, c = (scheduler(redis_server, name) for name in "abc")
    for s in (a, b, c):
        s.heartbeat(Load(capacity=4))
    client = scheduler(redis_server)
    for i in range(10):
        client.submit("a", "front", f"a{i}", b"x")
    for i in range(2):
        client.submit("c", "front", f"c{i}", b"x")
    stolen = b.pull(8)
    # the newest of a's (the longest queue), and no more than half of it
    assert [p.request_id for p in stolen] == ["a9", "a8", "a7", "a6", "a5"]
    assert {p.stolen_from for p in stolen} == {"a"}
    assert [p.request_id for p in a.pull(8)] == ["a0", "a1", "a2", "a3", "a4"]
    assert b.pull(8, steal=False) == []
    # a prefill instance steals from no mixed one
    p = scheduler(redis_server, "p", role="prefill")
    p.heartbeat(Load(capacity=4))
    assert p.pull(8) == []


def test_a_dead_instances_queue_is_taken_over_and_its_running_requests_ended(redis_server):
    a = scheduler(redis_server, "a", ttl=0.3)
    b = scheduler(redis_server, "b", ttl=0.3)
    a.heartbeat(Load())
    b.heartbeat(Load())
    client = scheduler(redis_server)
    for i in range(4):
        client.submit("a", "front", f"r{i}", b"x")
    assert [p.request_id for p in a.pull(2)] == ["r0", "r1"]
    assert b.reap(failure) == []  # a is live
    time.sleep(0.45)  # a stops reporting; b goes on
    b.heartbeat(Load())
    assert b.reap(failure) == ["a"]
    assert b.reap(failure) == []  # once
    assert sorted(p.request_id for p in b.pull(8, steal=False)) == ["r2", "r3"]
    ended = sorted(client.results("front", timeout=1))
    assert len(ended) == 2 and ended[0].startswith(b"failed r0: the instance a") and b"no heartbeat" in ended[0]
    assert ended[1].startswith(b"failed r1")
    assert set(b.live()) == {"b"}
    assert {m.decode() for m in b.client.smembers("fd:t:instances")} == {"b"}


def test_aborts_reach_a_queued_or_a_running_request(redis_server):
    a = scheduler(redis_server, "a")
    a.heartbeat(Load())
    client = scheduler(redis_server)
    client.submit("a", "front", "queued", b"x")
    client.submit("a", "front", "running", b"y")
    client.submit("a", "front", "next", b"z")
    assert client.abort("queued") == "queued"
    assert a.pull(1) == []  # the aborted one is taken off the queue and skipped, not run
    assert [p.request_id for p in a.pull(1)] == ["running"]
    assert client.abort("running") == "running"
    assert a.aborts() == ["running"]
    assert a.aborts() == []
    assert client.abort("never-submitted") == "unknown"


def test_the_choice_of_an_instance_follows_the_reported_load(redis_server):
    client = scheduler(redis_server)
    with pytest.raises(SchedulerUnavailableError, match="no live mixed instance"):
        client.choose()
    busy, idle = scheduler(redis_server, "busy"), scheduler(redis_server, "idle")
    busy.heartbeat(Load(running=8, waiting=3, capacity=8))
    idle.heartbeat(Load(running=1, capacity=8))
    assert client.choose() == "idle"  # 1 of 8 slots in use against 11 of 8
    for i in range(12):
        client.submit("idle", "front", f"r{i}", b"x")  # queued in Redis counts too: 13 of 8
    assert client.choose() == "busy"
    # disaggregated: among the lightly loaded decode instances, at random
    for name, running in (("d1", 0), ("d2", 1), ("d3", 8)):
        scheduler(redis_server, name, role="decode").heartbeat(Load(running=running, capacity=8))
    picks = {client.choose(role="decode") for _ in range(60)}
    assert picks == {"d1", "d2"}


def test_load_reports_expire(redis_server):
    a = scheduler(redis_server, "a", ttl=0.2)
    a.heartbeat(Load(running=2, capacity=4))
    assert a.live()["a"].running == 2 and a.live()["a"].role == "mixed"
    time.sleep(0.35)
    assert a.live() == {}


def test_an_unreachable_redis_is_named_by_host_and_port():
    port = free_port()
    with pytest.raises(SchedulerUnavailableError, match=rf"Redis at 127\.0\.0\.1:{port} is unreachable"):
        connect(RedisAddress(port=port), timeout=0.5)


def test_bad_settings_are_refused(redis_server):
    with pytest.raises(ValueError, match="role 'both'"):
        scheduler(redis_server, "a", role="both")
    with pytest.raises(ValueError, match="--scheduler-ttl 0"):
        scheduler(redis_server, "a", ttl=0)


def test_fd_serve_stops_at_once_naming_a_redis_it_cannot_reach():
    """Before the model loads: one line, the host and port, exit status 2."""
    import subprocess
    import sys

    port = free_port()
    done = subprocess.run([sys.executable, "-m", "fd_server", "--scheduler-name", "global", "--scheduler-port",
                           str(port), "--host", "127.0.0.1", "--port", "0", "--load-format", "dummy"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("fd: error:")]
    assert len(lines) == 1 and f"Redis at 127.0.0.1:{port} is unreachable" in lines[0], done.stderr
