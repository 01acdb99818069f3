"""The global scheduler: fd instances coordinated through Redis (``--scheduler-name global``).

FastDeploy's design, on the ``redis`` client: each instance has a queue in Redis, pulls work
from it while it has room, reports its load under a key that expires (``--scheduler-ttl``), and
when idle steals from the tail of the longest queue of a live instance. An instance whose load
key expired is dead: the first live instance to notice takes its queue over and ends the
requests it was running with an error sent to whoever submitted them, so none is lost silently.

Requests and results are opaque bytes here (the engine's wire messages); this module only moves
them. Keys, under ``fd:{topic}:``:

- ``instances``: the set of instance ids that registered (live ones also have a ``load:``);
- ``load:{id}``: the instance's ``Load`` (msgpack), expiring after the TTL; ``info:{id}``: what
  it announced of its engine (for a front end), expiring with it;
- ``queue:{id}``: request ids waiting for that instance, oldest first;
- ``req``: request id -> ``Envelope`` (who submitted it, its payload, its prompt length);
- ``owner``: request id -> the instance running it; ``running:{id}``: the ids it runs (a
  request handed from a prefill to a decode instance changes owner: ``hand_over``);
- ``abort:{id}``: request ids the instance is asked to abort;
- ``results:{origin}``: result batches for a submitter, oldest first.

Pulling, stealing and taking a dead instance's queue over are Lua scripts, so a request id is
in exactly one queue or one ``running`` set at any time.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from fd_core.errors import SchedulerUnavailableError

log = logging.getLogger("fd.cluster")

ROLES = ("mixed", "prefill", "decode")
LIGHT_SLACK = 0.25  # of an instance's capacity: how much heavier than the lightest still counts as light


@dataclass(frozen=True)
class RedisAddress:
    host: str = "127.0.0.1"
    port: int = 6379
    password: str | None = None
    db: int = 0

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def connect(address: RedisAddress, timeout: float = 2.0):
    """A client of the Redis at ``address``, checked with a PING; SchedulerUnavailableError,
    naming the host and port, where it cannot be reached."""
    try:
        import redis
    except ImportError:
        from fd_core.errors import ConfigError

        raise ConfigError("--scheduler-name global needs the redis client: pip install 'fd-core[cluster]'") from None
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # no retries inside the client (redis-py's default retries with backoff held a step for
    # seconds when Redis was down): every caller here has its own cadence to try again at
    client = redis.Redis(host=address.host, port=address.port, password=address.password, db=address.db,
                         socket_connect_timeout=timeout, socket_timeout=timeout, retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise SchedulerUnavailableError(f"the global scheduler's Redis at {address} refused the password "
                                        f"(--scheduler-password): {exc}") from None
    except redis.RedisError as exc:
        raise SchedulerUnavailableError(f"the global scheduler's Redis at {address} is unreachable "
                                        f"(--scheduler-host/--scheduler-port): {exc}") from None
    return client


class Load(msgspec.Struct, array_like=True):
    """What an instance reports on each heartbeat."""

    role: str = "mixed"
    running: int = 0  # sequences it runs
    waiting: int = 0  # sequences admitted but not yet running
    free_blocks: int = 0
    num_blocks: int = 0
    capacity: int = 0  # sequences it may run at once (max_num_seqs)
    served: int = 0  # requests it finished since it started
    time: float = 0.0  # the report's wall-clock time
    # a decode instance: where its KV-cache connector listens, and what its KV cache holds
    # (a prefill instance sends only to a decode instance whose layout is its own)
    kv_endpoint: str = ""
    kv_layout: str = ""


class Envelope(msgspec.Struct, array_like=True):
    origin: str  # where results go: results:{origin}
    payload: bytes
    prompt_tokens: int = 0
    submitted: float = 0.0


@dataclass
class Pulled:
    request_id: str
    origin: str
    payload: bytes
    prompt_tokens: int
    stolen_from: str | None = None  # the instance whose queue it came from, when not ours


# KEYS: the source queue, our running set, the owner hash; ARGV: n, "head"|"tail", our id.
# Takes up to n ids from the queue into running, recording the owner.
_PULL = """
local ids = {}
for i = 1, tonumber(ARGV[1]) do
  local id
  if ARGV[2] == 'tail' then id = redis.call('RPOP', KEYS[1]) else id = redis.call('LPOP', KEYS[1]) end
  if not id then break end
  redis.call('SADD', KEYS[2], id)
  redis.call('HSET', KEYS[3], id, ARGV[3])
  ids[#ids + 1] = id
end
return ids
"""

# KEYS: the dead instance's queue, our queue, its running set, the owner hash, its abort list,
# the instances set; ARGV: its id. Moves its queue behind ours, empties its running set
# (returning the ids) and forgets it.
_TAKE_OVER = """
local moved = 0
while true do
  local id = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not id then break end
  moved = moved + 1
end
local running = redis.call('SMEMBERS', KEYS[3])
for _, id in ipairs(running) do redis.call('HDEL', KEYS[4], id) end
redis.call('DEL', KEYS[3], KEYS[5])
redis.call('SREM', KEYS[6], ARGV[1])
return {moved, running}
"""


# KEYS: the owner hash, the running set of the owner, of the new owner; ARGV: the request id,
# the owner, the new owner ("" to forget the request). Only while the owner still holds it: a
# reaper may have ended it meanwhile (1 moved, 0 not).
_MOVE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('SREM', KEYS[2], ARGV[1])
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('SADD', KEYS[3], ARGV[1])
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
end
return 1
"""

# KEYS: the owner hash, the req hash; ARGV: the request id, the abort list's key prefix.
# Running: ask its instance to abort it (1). Queued: drop its envelope, which the puller then
# skips (0). Unknown: -1.
_ABORT = """
local owner = redis.call('HGET', KEYS[1], ARGV[1])
if owner then
  redis.call('RPUSH', ARGV[2] .. owner, ARGV[1])
  return 1
end
if redis.call('HDEL', KEYS[2], ARGV[1]) == 1 then return 0 end
return -1
"""


class GlobalScheduler:
    """One connection's view of the cluster ``topic``: as an instance (``instance`` set:
    heartbeat, pull, publish, reap) and as a submitter (submit, read results, abort)."""

    def __init__(self, client, topic: str = "default", instance: str | None = None, ttl: float = 10.0,
                 role: str = "mixed") -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
        if ttl <= 0:
            raise ValueError(f"--scheduler-ttl {ttl}: must be positive (seconds)")
        self.client = client
        self.prefix = f"fd:{topic}:"
        self.instance = instance
        self.ttl = ttl
        self.role = role
        self._pull = client.register_script(_PULL)
        self._take_over = client.register_script(_TAKE_OVER)
        self._abort = client.register_script(_ABORT)
        self._move = client.register_script(_MOVE)

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # -- an instance ---------------------------------------------------------------------

    def heartbeat(self, load: Load) -> None:
        """Report ``load`` (expiring after the TTL) and register as live."""
        load.role = self.role
        load.time = time.time()
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.key("load", self.instance), msgspec.msgpack.encode(load), px=int(self.ttl * 1000))
        pipe.pexpire(self.key("info", self.instance), int(self.ttl * 1000))
        pipe.sadd(self.key("instances"), self.instance)
        pipe.execute()

    def announce(self, info: bytes) -> None:
        """Publish what a front end needs to know of this instance's engine (the core's
        ``Ready``: model, lengths, what it cannot honour), kept as long as its load reports."""
        self.client.set(self.key("info", self.instance), info, px=int(self.ttl * 1000))

    def pull(self, n: int, steal: bool = True) -> list[Pulled]:
        """Up to ``n`` requests: the oldest of our queue first; if it is empty and ``steal``,
        the newest of the longest queue among live instances of our role (work stealing)."""
        if n <= 0:
            return []
        ids = self._pull(keys=[self.key("queue", self.instance), self.key("running", self.instance),
                               self.key("owner")], args=[n, "head", self.instance])
        victim = None
        if not ids and steal:
            victim = self._longest_queue()
            if victim is not None:
                # half the victim's queue at most, so that two thieves do not empty it into one
                length = self.client.llen(self.key("queue", victim))
                ids = self._pull(keys=[self.key("queue", victim), self.key("running", self.instance),
                                       self.key("owner")], args=[min(n, max(1, length // 2)), "tail", self.instance])
        if not ids:
            return []
        ids = [i.decode() for i in ids]
        envelopes = self.client.hmget(self.key("req"), ids)
        pulled = []
        for request_id, raw in zip(ids, envelopes):
            if raw is None:  # aborted while queued: nothing to run
                self.finish([request_id])
                continue
            env = msgspec.msgpack.decode(raw, type=Envelope)
            pulled.append(Pulled(request_id, env.origin, env.payload, env.prompt_tokens, victim))
        return pulled

    def _longest_queue(self) -> str | None:
        best, best_len = None, 0
        for other, load in self.live().items():
            if other == self.instance or load.role != self.role:
                continue
            length = self.client.llen(self.key("queue", other))
            if length > best_len:
                best, best_len = other, length
        return best

    def finish(self, request_ids: list[str]) -> None:
        """Forget requests this instance finished (or failed)."""
        if not request_ids:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.srem(self.key("running", self.instance), *request_ids)
        pipe.hdel(self.key("owner"), *request_ids)
        pipe.hdel(self.key("req"), *request_ids)
        pipe.execute()

    def hand_over(self, request_id: str, target: str, owner: str | None = None) -> bool:
        """Make ``target`` (a decode instance) the owner of a request ``owner`` (default: this
        instance) holds: aborts go to it, and its death ends the request. False, and nothing
        changed, where ``owner`` no longer holds it (reaped: its requester was told)."""
        owner = owner or self.instance
        keys = [self.key("owner"), self.key("running", owner), self.key("running", target)]
        return bool(self._move(keys=keys, args=[request_id, owner, target]))

    def end(self, request_id: str, owner: str) -> bool:
        """Forget a request ``owner`` was given but will not run (a failed hand-over); False
        where ``owner`` no longer holds it (reaped: its requester was told)."""
        keys = [self.key("owner"), self.key("running", owner), self.key("running", owner)]
        ended = bool(self._move(keys=keys, args=[request_id, owner, ""]))
        self.client.hdel(self.key("req"), request_id)
        return ended

    def publish(self, batches: dict[str, list[bytes]]) -> None:
        """Send each origin its result batches, in order."""
        if not batches:
            return
        pipe = self.client.pipeline(transaction=False)
        for origin, payloads in batches.items():
            pipe.rpush(self.key("results", origin), *payloads)
            # a submitter that went away must not leave its results behind for ever
            pipe.expire(self.key("results", origin), max(60, int(self.ttl * 6)))
        pipe.execute()

    def aborts(self) -> list[str]:
        """Request ids this instance was asked to abort since the last call."""
        key = self.key("abort", self.instance)
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        ids, _ = pipe.execute()
        return [i.decode() for i in ids]

    def reap(self, failure: Callable[[str, str], bytes]) -> list[str]:
        """Take over the queue of every registered instance whose load key expired, and end the
        requests it was running: ``failure(request_id, message)`` is the result batch each one's
        submitter gets. Returns the instances reaped."""
        reaped = []
        registered = {m.decode() for m in self.client.smembers(self.key("instances"))}
        live = set(self.live())
        for dead in sorted(registered - live - {self.instance}):
            # one reaper per dead instance
            if not self.client.set(self.key("reaping", dead), self.instance, nx=True, px=int(self.ttl * 1000)):
                continue
            moved, running = self._take_over(
                keys=[self.key("queue", dead), self.key("queue", self.instance), self.key("running", dead),
                      self.key("owner"), self.key("abort", dead), self.key("instances")], args=[dead])
            running = [i.decode() for i in running]
            envelopes = self.client.hmget(self.key("req"), running) if running else []
            for request_id, raw in zip(running, envelopes):
                if raw is None:
                    continue
                env = msgspec.msgpack.decode(raw, type=Envelope)
                message = (f"the instance {dead} running this request stopped reporting to the global scheduler "
                           f"(no heartbeat for {self.ttl:g} s); the request was ended")
                self.client.rpush(self.key("results", env.origin), failure(request_id, message))
            if running:
                self.client.hdel(self.key("req"), *running)
            log.warning("instance %s stopped reporting: %d queued requests moved to %s, %d running ones ended",
                        dead, moved, self.instance, len(running))
            reaped.append(dead)
        return reaped

    def leave(self) -> None:
        """A clean stop: our queue goes to the least-loaded live instance of our role (or stays
        for whoever starts next), and we stop being live."""
        others = [i for i, load in self.live().items() if i != self.instance and load.role == self.role]
        if others:
            target = min(others, key=lambda i: self.client.llen(self.key("queue", i)))
            while self.client.lmove(self.key("queue", self.instance), self.key("queue", target), "LEFT", "RIGHT"):
                pass
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(self.key("load", self.instance))
        pipe.srem(self.key("instances"), self.instance)
        pipe.execute()

    # -- the cluster, as seen by a submitter ---------------------------------------------

    def live(self) -> dict[str, Load]:
        """The instances whose load key has not expired, with their last report."""
        ids = sorted(m.decode() for m in self.client.smembers(self.key("instances")))
        if not ids:
            return {}
        raws = self.client.mget([self.key("load", i) for i in ids])
        return {i: msgspec.msgpack.decode(raw, type=Load) for i, raw in zip(ids, raws) if raw is not None}

    def info(self, instance: str) -> bytes | None:
        """What ``instance`` announced, None if it has not (or is gone)."""
        return self.client.get(self.key("info", instance))

    def choose(self, role: str = "mixed", where: Callable[[str, Load], bool] | None = None) -> str:
        """An instance of ``role`` for a new request (see ``pick``)."""
        return self.pick(role, where)[0]

    def pick(self, role: str = "mixed", where: Callable[[str, Load], bool] | None = None) -> tuple[str, Load]:
        """An instance of ``role`` for a new request, with its last report, by its work per
        sequence slot: requests queued for it in Redis, waiting and running in it, over its
        capacity. Mixed: the lightest. Prefill and decode (FastDeploy's policy for disaggregated
        clusters): one at random among those within ``LIGHT_SLACK`` of the lightest, so that
        several schedulers acting on the same reports do not all pick the same instance."""
        candidates = {i: load for i, load in self.live().items()
                      if load.role == role and (where is None or where(i, load))}
        if not candidates:
            which = " that can take this request" if where is not None else ""
            raise SchedulerUnavailableError(f"no live {role} instance{which} is registered with the global scheduler")
        pipe = self.client.pipeline(transaction=False)
        for i in candidates:
            pipe.llen(self.key("queue", i))
        queued = pipe.execute()
        scores = {i: (q + load.waiting + load.running) / max(1, load.capacity)
                  for (i, load), q in zip(candidates.items(), queued)}
        lightest = min(scores.values())
        if role == "mixed":
            chosen = min(scores, key=lambda i: (scores[i], i))
        else:
            chosen = random.choice(sorted(i for i, score in scores.items() if score <= lightest + LIGHT_SLACK))
        return chosen, candidates[chosen]

    def submit(self, instance: str, origin: str, request_id: str, payload: bytes, prompt_tokens: int = 0) -> None:
        """Queue a request for ``instance``; its results go to ``results:{origin}``."""
        env = Envelope(origin, payload, prompt_tokens, time.time())
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.key("req"), request_id, msgspec.msgpack.encode(env))
        pipe.rpush(self.key("queue", instance), request_id)
        pipe.execute()

    def results(self, origin: str, timeout: float = 1.0) -> list[bytes]:
        """The result batches for ``origin`` (waiting up to ``timeout`` for the first)."""
        key = self.key("results", origin)
        first = self.client.blpop([key], timeout=timeout)
        if first is None:
            return []
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(key, 0, -1)
        pipe.delete(key)
        rest, _ = pipe.execute()
        return [first[1], *rest]

    def abort(self, request_id: str, key: str | None = None) -> str:
        """Stop a request wherever it is: "running" (its instance is asked to abort it, by
        ``key``: the request id, or ``instance.abort_key`` for one of its sequences), "queued"
        (dropped: the instance that pulls it skips it; a sequence's abort drops nothing) or
        "unknown" (finished, or never submitted)."""
        if key is not None and key != request_id:  # one sequence: only a running request has them
            owner = self.client.hget(self.key("owner"), request_id)
            if owner is None:
                return "unknown"
            self.client.rpush(self.key("abort", owner.decode()), key)
            return "running"
        where = self._abort(keys=[self.key("owner"), self.key("req")], args=[request_id, self.key("abort", "")])
        return {1: "running", 0: "queued"}.get(int(where), "unknown")


def new_instance_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"
