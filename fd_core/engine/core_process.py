"""The engine-core process of ``fd serve``: an EngineCore behind two ZeroMQ sockets.

The HTTP process (``client.AsyncEngineClient``) tokenizes, detokenizes and talks HTTP; this
process only schedules and computes, so neither one's GIL stalls the other. The client binds
both sockets and spawns this process, which connects:

    client PUSH --(AddRequest | Abort | Shutdown)--> core PULL
    client PULL <--(Ready | Failed | StepOutputs)--- core PUSH

Messages are msgpack-encoded ``msgspec.Struct``s sent as arrays (field names never cross).
Every step's outputs travel with the core's current stats; an idle core sends the stats alone
every ``HEARTBEAT_S``, so the client's metrics stay fresh.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from fd_core.engine.config import EngineConfig
from fd_core.engine.parent import watch_parent
from fd_core.engine.sampling_params import SamplingParams

log = logging.getLogger("fd.engine")

HEARTBEAT_S = 0.25  # idle stats interval; also how often an idle core looks for its parent


# -- client -> core --------------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    token_ids: list[int]
    params: dict[str, Any]  # SamplingParams init fields that differ from the defaults
    cache_salt: str | None = None  # keeps the request's prefix-cache entries apart from others'


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    index: int | None = None  # one sequence of the request, or all of them


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ClientMessage = AddRequest | Abort | Shutdown


# -- core -> client --------------------------------------------------------------------------

class Ready(msgspec.Struct, tag="ready", array_like=True):
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    max_num_batched_tokens: int  # as resolved against the backend
    chunked_prefill: bool
    unavailable: dict[str, str]  # sampling fields the core cannot honour -> why (core.check_params)


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """An error to re-raise on the client's side: for one request when ``request_id`` is set,
    otherwise for the whole core (at start-up, or a step that raised, after which it exits)."""

    error_type: str
    message: str
    request_id: str | None = None


class WireOutput(msgspec.Struct, array_like=True):
    """A ``CoreOutput`` on the wire."""

    request_id: str
    index: int
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]
    finish_reason: str | None
    stop_reason: int | None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied to this sequence
    time_in_queue: float | None = None  # on a sequence's first token (CoreOutput says what)
    prefill_time: float | None = None
    # PromptLogprobs' fields (logprobs, ranks, top), with a request's first token when asked
    prompt_logprobs: tuple[list[float], list[int], list[list[tuple[int, float]]]] | None = None


class Stats(msgspec.Struct, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0  # blocks requests can use: the reserved block 0 is not counted
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    preemptions_total: int = 0  # by swap and by recompute
    # tokens: the prompt tokens the model actually ran (prefix-cache hits and forks skip some,
    # recomputation after a preemption repeats some)
    prompt_tokens_computed_total: int = 0
    # the prefix cache, in tokens looked up / found at admission (readmissions included)
    prefix_cache_queried_tokens_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_hit_rate: float = 0.0  # hit / queried since the core started
    prefix_cache_blocks: int = 0  # blocks holding a cached prefix now (in use or free)
    prefix_cache_evictions_total: int = 0
    swapped_out_total: int = 0  # preemptions by swap to host memory
    recomputed_total: int = 0  # preemptions by recompute
    num_swapped: int = 0  # sequences whose KV cache is in host memory now
    # speculative decoding (vLLM's spec_decode counters): steps of a sequence that verified
    # drafts, the drafts, those accepted, and those accepted per position (empty: speculation off)
    spec_drafts_total: int = 0
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_accepted_per_pos: list[int] = []


class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[WireOutput]
    stats: Stats


CoreMessage = Ready | Failed | StepOutputs


# -- SamplingParams across the boundary ------------------------------------------------------

_PARAM_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.init}


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The init fields of ``params`` that differ from the defaults (most requests send few)."""
    out = {}
    for name, default in _PARAM_DEFAULTS.items():
        value = getattr(params, name)
        if value != default or type(value) is not type(default):
            out[name] = list(value) if isinstance(value, tuple) else value
    if params.structured_outputs is not None:
        out["structured_outputs"] = params.structured_outputs.to_dict()
    return out


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    # Built anew, so the core validates what it runs rather than trusting the sender.
    return SamplingParams(**fields)


# -- the process -----------------------------------------------------------------------------

def run_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
             log_level: int | str | None = None) -> None:
    """Entry point of the spawned process. Exits non-zero if start-up or a step fails.
    ``log_level``: the client's (``fd_core.logs.effective_level``); None: ``$FD_LOG_LEVEL``."""
    from fd_core.logs import configure

    configure(log_level, role="engine")  # before anything imports a tensor library
    # Ctrl-C reaches the whole process group; the parent decides when this process stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(parent_pid)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.setsockopt(zmq.LINGER, 0)
    inbox.connect(input_address)
    outbox = ctx.socket(zmq.PUSH)
    # Unbounded: a slow client must never block a step (and a dead one is noticed via the pid).
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        try:
            from fd_core.engine.core import EngineCore

            core = EngineCore(config)
            # the runtime may have hooked SIGTERM to dump a crash report; from the client it
            # is an ordinary stop request
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except BaseException as e:  # noqa: BLE001 - every start-up failure goes to the client
            if not isinstance(e, Exception) or type(e).__module__ != "fd_core.errors":
                traceback.print_exc()
            outbox.send(encoder.encode(Failed(type(e).__name__, str(e))))
            code = 1
            return
        outbox.send(encoder.encode(Ready(
            model=config.model, max_model_len=core.max_model_len,
            vocab_size=core.model_config.vocab_size, eos_token_ids=sorted(core.eos_token_ids),
            num_blocks=core.pool.capacity, max_num_batched_tokens=config.max_num_batched_tokens,
            chunked_prefill=config.enable_chunked_prefill, unavailable=core.unavailable(),
        )))
        try:
            _serve(core, inbox, outbox, encoder, parent_pid)
        except Exception as e:  # a failed step leaves the core's state unknown: report and exit
            traceback.print_exc()
            outbox.send(encoder.encode(Failed(type(e).__name__, str(e))))
            code = 1
        finally:
            core.shutdown()  # its tensor-parallel ranks, if any
    finally:
        inbox.close()
        outbox.close(linger=1000)  # let the last message (Failed, final stats) reach the client
        ctx.term()
        sys.stdout.flush()
        sys.stderr.flush()
        if code:
            os._exit(code)


def _stats(core) -> Stats:
    pool, s, c = core.pool, core.stats, core.cache_stats()
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
    )


def _wire(o) -> WireOutput:
    p = o.prompt_logprobs
    return WireOutput(o.request_id, o.index, o.token_id, o.logprob, o.rank, o.top,
                      o.finish_reason, o.stop_reason, o.num_cached_tokens, o.time_in_queue, o.prefill_time,
                      None if p is None else (p.logprobs, p.ranks, p.top))


def _serve(core, inbox: zmq.Socket, outbox: zmq.Socket, encoder: msgspec.msgpack.Encoder,
           parent_pid: int) -> None:
    decoder = msgspec.msgpack.Decoder(ClientMessage)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_sent = time.monotonic()
    while True:
        if not core.has_unfinished_requests():
            wait = max(0.0, HEARTBEAT_S - (time.monotonic() - last_sent))
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
                outbox.send(encoder.encode(Failed(type(e).__name__, str(e), msg.request_id)))
        if core.has_unfinished_requests():
            outputs = [_wire(o) for o in core.step()]
        elif handled or time.monotonic() - last_sent >= HEARTBEAT_S:
            outputs = []  # idle: stats only (and at once after an abort freed blocks)
        else:
            continue
        outbox.send(encoder.encode(StepOutputs(outputs, _stats(core))))
        last_sent = time.monotonic()
