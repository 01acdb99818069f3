"""The messages between the engine client and the engine core, and their encoding.

msgpack-encoded ``msgspec.Struct``s sent as arrays (field names never cross). The same bytes
travel over the ZeroMQ sockets of one instance (``core_process``) and through Redis between
instances (``fd_core.cluster``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from fd_core.engine.sampling_params import SamplingParams


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


def wire_id(number: int, client: int, clients: int) -> str:
    """A request's id on the wire: a client's running number, prefixed with the client's
    index where one core serves several clients (HTTP processes), so its outputs find their way
    back (``client_of``)."""
    return f"{client}/{number}" if clients > 1 else str(number)


def client_of(request_id: str) -> int:
    """The index of the client that sent a request whose wire id ``wire_id`` made for several
    clients."""
    return int(request_id.split("/", 1)[0])


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
    token_ids: list[int]
    logprob: float
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]
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
    # prefill/decode disaggregation: requests whose KV cache this instance sent (prefill) or
    # received (decode), the bytes, the seconds sends took until acknowledged (prefill), and the
    # sends that failed
    kv_transfers_total: int = 0
    kv_transfer_bytes_total: int = 0
    kv_transfer_seconds_total: float = 0.0
    kv_transfer_failures_total: int = 0
    kv_staging_seconds_total: float = 0.0  # copying KV blocks device -> host (prefill) or host -> device (decode)


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
