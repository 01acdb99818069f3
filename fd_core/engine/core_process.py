"""The engine-core process of ``fd serve``: an EngineCore behind ZeroMQ sockets.

The HTTP process (``client.AsyncEngineClient``) tokenizes, detokenizes and talks HTTP; this
process only schedules and computes, so neither one's GIL stalls the other. Each client binds
two sockets and this process connects to them (``core_handle.CoreHandle`` spawns it, with a
control socket of its own that only sends Shutdown):

    client PUSH --(AddRequest | Abort | Shutdown)--> core PULL (one for every client and the control)
    client PULL <--(Ready | Failed | StepOutputs)--- core PUSH (one a client)

With several clients (HTTP processes) each request's outputs go to the client that sent it,
named in its wire id (``wire.client_of``); Ready, a core's failure and the stats go to all.
The messages are ``wire``'s: msgpack-encoded ``msgspec.Struct``s sent as arrays.
Every step's outputs travel with the core's current stats; an idle core sends the stats alone
every ``HEARTBEAT_S``, so the clients' metrics stay fresh.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from fd_core.cluster.config import SchedulerConfig
from fd_core.engine.config import EngineConfig
from fd_core.engine.parent import watch_parent
from fd_core.engine.wire import (
    Abort,
    ClientMessage,
    Failed,
    Ready,
    Shutdown,
    Stats,
    StepOutputs,
    WireOutput,
    client_of,
    params_from_wire,
)
from fd_core.heap import freeze_startup_heap

if TYPE_CHECKING:
    from fd_core.cluster.instance import ClusterInbox

log = logging.getLogger("fd.engine")

HEARTBEAT_S = 0.25  # idle stats interval; also how often an idle core looks for its parent
CLUSTER_IDLE_POLL_S = 0.01  # how often an idle core of a cluster looks for requests in Redis


# -- the process -----------------------------------------------------------------------------

def run_core(config: EngineConfig, input_addresses: list[str], output_addresses: list[str], parent_pid: int,
             log_level: int | str | None = None, scheduler: SchedulerConfig | None = None,
             status_address: str | None = None) -> None:
    """Entry point of the spawned process, for the clients whose sockets are at
    ``input_addresses`` and ``output_addresses`` (client ``k``'s output is the ``k``-th);
    ``status_address``: the spawner's, which gets Ready or the core's failure alone. Exits
    non-zero if start-up or a step fails.
    ``log_level``: the client's (``fd_core.logs.effective_level``); None: ``$FD_LOG_LEVEL``.
    ``scheduler``: with ``--scheduler-name global``, requests come from the cluster's Redis
    (``fd_core.cluster.instance``) and their outputs go back through it; the sockets then carry
    only the stats and the stop request."""
    from fd_core.logs import configure

    configure(log_level, role="engine")  # before anything imports a tensor library
    # Ctrl-C reaches the whole process group; the parent decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(parent_pid)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    for address in input_addresses:
        inbox.connect(address)
    outbox = Outboxes(ctx, output_addresses, status_address)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        try:
            from fd_core.engine.core import EngineCore

            cluster = None
            if scheduler is not None and scheduler.is_global:
                from fd_core.cluster.disaggregation import configure_engine

                config = configure_engine(config, scheduler)
            core = EngineCore(config)
            if scheduler is not None and scheduler.is_global:
                from fd_core.cluster.instance import ClusterInbox

                cluster = ClusterInbox(scheduler, config.max_num_seqs, core)
            # the runtime may have hooked SIGTERM to dump a crash report; from the client it
            # is an ordinary stop request
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except BaseException as e:  # noqa: BLE001 - every start-up failure goes to the client
            if not isinstance(e, Exception) or type(e).__module__ != "fd_core.errors":
                traceback.print_exc()
            outbox.send_all(encoder.encode(Failed(type(e).__name__, str(e))))
            code = 1
            return
        ready = encoder.encode(Ready(
            model=config.model, max_model_len=core.max_model_len,
            vocab_size=core.model_config.vocab_size, eos_token_ids=sorted(core.eos_token_ids),
            num_blocks=core.pool.capacity, max_num_batched_tokens=config.max_num_batched_tokens,
            chunked_prefill=config.enable_chunked_prefill, unavailable=core.unavailable(),
        ))
        if cluster is not None:
            cluster.announce(ready)
        outbox.send_all(ready)
        freeze_startup_heap()
        try:
            _serve(core, inbox, outbox, encoder, parent_pid, cluster)
        except Exception as e:  # a failed step leaves the core's state unknown: report and exit
            traceback.print_exc()
            outbox.send_all(encoder.encode(Failed(type(e).__name__, str(e))))
            code = 1
        finally:
            if cluster is not None:
                cluster.leave()
            core.shutdown()  # its tensor-parallel ranks, if any
    finally:
        inbox.close()
        outbox.close(linger=1000)  # let the last message (Failed, final stats) reach the clients
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            os._exit(code)


def _stats(core, cluster: ClusterInbox | None = None) -> Stats:
    pool, s, c = core.pool, core.stats, core.cache_stats()
    transfer = cluster.transfer_stats if cluster is not None else None
    if transfer is not None:  # prefill: sent; decode: received
        s = {**s, "kv_transfers": transfer.requests, "kv_transfer_bytes": transfer.bytes,
             "kv_transfer_seconds": transfer.seconds, "kv_transfer_failures": transfer.failures,
             "kv_staging_seconds": transfer.staging_seconds + s["kv_import_seconds"]}
    return Stats(
        num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
        kv_cache_usage=pool.usage(), num_free_blocks=pool.num_free, num_blocks=pool.capacity,
        prompt_tokens_total=s["prompt_tokens"], generation_tokens_total=s["generation_tokens"],
        preemptions_total=s["preemptions"], prompt_tokens_computed_total=s["prompt_tokens_computed"],
        prefix_cache_queried_tokens_total=int(c["prefix_cache_queried_tokens"]),
        prefix_cache_hit_tokens_total=int(c["prefix_cache_hit_tokens"]),
        prefix_cache_hit_rate=float(c["prefix_cache_hit_rate"]),
        prefix_cache_blocks=int(c["prefix_cache_blocks"]),
        prefix_cache_evictions_total=int(c["prefix_cache_evictions"]),
        swapped_out_total=int(c["swapped_out"]), recomputed_total=int(c["recomputed"]),
        num_swapped=int(c["num_swapped"]),
        spec_drafts_total=s.get("spec_drafts", 0), spec_draft_tokens_total=s.get("spec_draft_tokens", 0),
        spec_accepted_tokens_total=s.get("spec_accepted_tokens", 0),
        spec_accepted_per_pos=list(s.get("spec_accepted_per_pos", ())),
        kv_transfers_total=s.get("kv_transfers", 0), kv_transfer_bytes_total=s.get("kv_transfer_bytes", 0),
        kv_transfer_seconds_total=s.get("kv_transfer_seconds", 0.0),
        kv_transfer_failures_total=s.get("kv_transfer_failures", 0),
        kv_staging_seconds_total=s.get("kv_staging_seconds", 0.0),
    )


def _wire(o) -> WireOutput:
    p = o.prompt_logprobs
    return WireOutput(o.request_id, o.index, o.token_ids, o.logprob, o.logprobs, o.ranks, o.top,
                      o.finish_reason, o.stop_reason, o.num_cached_tokens, o.time_in_queue, o.prefill_time,
                      None if p is None else (p.logprobs, p.ranks, p.top))


class Outboxes:
    """The core's PUSH socket to each client, and to its spawner's status socket."""

    def __init__(self, ctx: zmq.Context, addresses: list[str], status_address: str | None = None) -> None:
        self.sockets = [self._connect(ctx, address) for address in addresses]
        self.status = None if status_address is None else self._connect(ctx, status_address)

    @staticmethod
    def _connect(ctx: zmq.Context, address: str) -> zmq.Socket:
        socket = ctx.socket(zmq.PUSH)
        # Unbounded: a slow client must never block a step (and a dead one is noticed via the pid).
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.connect(address)
        return socket

    def send_all(self, frame: bytes) -> None:
        """Ready or a failure of the whole core: to every client and the spawner."""
        for socket in self.sockets:
            socket.send(frame)
        if self.status is not None:
            self.status.send(frame)

    def send_to(self, request_id: str, frame: bytes) -> None:
        self.sockets[client_of(request_id) if len(self.sockets) > 1 else 0].send(frame)

    def send_outputs(self, encoder: msgspec.msgpack.Encoder, outputs: list[WireOutput], stats: Stats) -> None:
        """A step's outputs, each to its request's client, with the stats to every client."""
        if len(self.sockets) == 1:
            self.sockets[0].send(encoder.encode(StepOutputs(outputs, stats)))
            return
        mine: list[list[WireOutput]] = [[] for _ in self.sockets]
        for output in outputs:
            mine[client_of(output.request_id)].append(output)
        for socket, theirs in zip(self.sockets, mine, strict=True):
            socket.send(encoder.encode(StepOutputs(theirs, stats)))

    def close(self, linger: int) -> None:
        for socket in self.sockets + ([self.status] if self.status is not None else []):
            socket.close(linger=linger)


def _serve(core, inbox: zmq.Socket, outbox: Outboxes, encoder: msgspec.msgpack.Encoder,
           parent_pid: int, cluster: ClusterInbox | None = None) -> None:
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_sent = time.monotonic()
    while True:
        if not core.has_unfinished_requests():
            wait = max(0.0, HEARTBEAT_S - (time.monotonic() - last_sent))
            if cluster is not None:  # new work comes from Redis, which cannot wake the poller
                wait = min(wait, CLUSTER_IDLE_POLL_S)
            poller.poll(int(wait * 1000))
            if os.getppid() != parent_pid:
                log.warning("the engine client is gone; the engine core exits")
                return
        handled = 0
        while True:  # take everything queued, without waiting
            try:
                frame = inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = decoder.decode(frame)
            except msgspec.DecodeError as e:
                log.error("dropped a malformed message: %s", e)
                continue
            if isinstance(msg, Shutdown):
                return
            handled += 1
            if isinstance(msg, Abort):
                core.abort(msg.request_id, msg.index)
                continue
            try:
                core.add_request(msg.request_id, msg.token_ids, params_from_wire(msg.params),
                                 msg.cache_salt)
            except Exception as e:  # this request only; the others go on
                outbox.send_to(msg.request_id, encoder.encode(Failed(type(e).__name__, str(e), msg.request_id)))
        if cluster is not None:
            handled += cluster.poll(core)
        if core.has_unfinished_requests():
            outputs = [_wire(o) for o in core.step()]
            if cluster is not None:  # every request came through Redis: so do the outputs
                cluster.publish(core, outputs)
                outputs = []
        elif handled or time.monotonic() - last_sent >= HEARTBEAT_S:
            outputs = []  # idle: stats only (and at once after an abort freed blocks)
        else:
            continue
        outbox.send_outputs(encoder, outputs, _stats(core, cluster))
        last_sent = time.monotonic()
