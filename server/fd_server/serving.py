"""What both generation endpoints share: submitting prompts, waiting for them while watching
for a disconnect, the SSE response, and the small text/logprob helpers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from fd_core.engine.outputs import Logprob, RequestOutput
from fd_core.engine.sampling_params import SamplingParams
from fd_server import request_log
from fd_server.errors import from_exception, request_timeout
from fd_server.protocol import PromptLogprob, PromptLogprobs
from fd_server.streams import EngineMonitor, RequestStream, follow
from fd_server.tools import ChatParsing

log = logging.getLogger("fd_server")

T = TypeVar("T")

# OpenAI reports impossible tokens with this instead of -inf, which JSON cannot carry
MIN_LOGPROB = -9999.0


class ClientDisconnected(Exception):
    """The client went away before its answer was ready."""


@dataclass
class ServerContext:
    """What the endpoint functions need, built once per app."""

    client: Any
    monitor: EngineMonitor
    model_name: str  # the first served name: what responses carry, as in vLLM
    # tokenization and chat templates run here, off the event loop (see offload)
    pool: concurrent.futures.Executor
    max_sequences_per_request: int | None = None  # prompts × n of one request
    request_timeout: float | None = None  # seconds from arrival until a request is aborted
    model_names: tuple[str, ...] = ()  # every name a request may ask for (--served-model-name a b)
    log_requests: bool = True  # a log line per request received and ended (request_log)
    parsing: ChatParsing = field(default_factory=ChatParsing)  # tool-call and reasoning parsers

    def __post_init__(self) -> None:
        self.model_names = self.model_names or (self.model_name,)

    @property
    def tokenizer(self) -> Any:
        return self.client.tokenizer

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the worker pool. A 10 MB prompt takes seconds to tokenize; on the
        event loop it would stall /health and every stream meanwhile (the tokenizer releases
        the GIL while it works)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Batch:
    """The engine requests of one HTTP request (one per prompt), followed together. With a
    ``timeout`` (seconds from ``arrival``) every one still running then is aborted and the
    request ends with a 504."""

    def __init__(self, monitor: EngineMonitor, base_id: str, arrival: float, timeout: float | None = None,
                 log_requests: bool = False) -> None:
        self.monitor = monitor
        self.base_id = base_id
        self.notify = asyncio.Event()
        self.streams: list[RequestStream] = []
        self.arrival = arrival  # time.monotonic() when the request came in, for the latency metrics
        self.log_requests = log_requests
        self._closed = False
        self._timer = None
        if timeout:
            self._timer = asyncio.get_running_loop().call_later(
                max(0.0, arrival + timeout - time.monotonic()), self._expire, timeout)

    def _expire(self, timeout: float) -> None:
        log.warning("request %s ran past --request-timeout %g s; aborting it", self.base_id, timeout)
        for stream in self.streams:
            stream.fail(request_timeout(timeout))  # its pump stops, which aborts it in the engine

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, prompt_text: str | None,
               cache_salt: str | None = None) -> None:
        request_id = self.base_id if not self.streams else f"{self.base_id}-{len(self.streams)}"
        if self.log_requests:
            request_log.received(request_id, prompt_token_ids, prompt_text, params)
        self.streams.append(self.monitor.open(request_id, prompt_token_ids, params, prompt_text,
                                              self.notify, self.arrival, cache_salt))

    def updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        return follow(self.streams, self.notify)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for stream in self.streams:
            stream.close()
        if self.log_requests and not self._closed:
            for stream in self.streams:
                request_log.ended(stream.request_id, self.arrival, stream.latest, stream.error)
        self._closed = True

    async def final(self, request: Request) -> list[RequestOutput]:
        """Wait for every prompt to finish; abort them all if the client disconnects first."""

        async def collect() -> list[RequestOutput]:
            async for _ in self.updates():
                pass
            return [s.latest for s in self.streams]  # type: ignore[misc]

        collecting = asyncio.ensure_future(collect())
        watching = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
            if collecting.done():
                return collecting.result()
            raise ClientDisconnected()
        finally:
            collecting.cancel()
            watching.cancel()
            self.close()


async def _disconnected(request: Request) -> None:
    # The body was read already, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """Server-sent events whose close callbacks run however the response ends: completed,
    failed, or cancelled because the client went away (even before the first byte)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(_guarded(events), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = [on_close]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for callback in self.on_close:
                try:
                    callback()
                except Exception:
                    log.exception("closing a stream failed")


def sse(payload: Any) -> str:
    text = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {text}\n\n"


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The status line is sent already, so a failure mid-stream becomes an error event
    (which the openai package raises as ``APIError``) and the stream closes without [DONE]."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        yield sse(json.dumps(from_exception(exc).body()))
        return
    yield "data: [DONE]\n\n"


# -- text and logprobs -------------------------------------------------------------------------


def safe_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def prompt_logprobs(request: Any, output: RequestOutput) -> PromptLogprobs | None:
    """The response's ``prompt_logprobs`` when ``request`` asked for them (completions' ``echo``
    with ``logprobs`` has the engine compute them too, for the echo alone), as vLLM's responses
    carry them (impossible tokens at OpenAI's floor, since JSON has no -inf)."""
    entries = output.prompt_logprobs
    if request.prompt_logprobs is None or entries is None:
        return None
    return [None if entry is None else
            {tid: PromptLogprob(logprob=safe_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
             for tid, lp in entry.items()} for entry in entries]


def token_text(entry: Logprob, token_id: int, tokenizer: Any) -> str:
    if entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


def top_entries(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely tokens of one step, best first."""
    ranked = [(tid, lp) for tid, lp in step.items() if lp.rank is not None and 1 <= lp.rank <= k]
    ranked.sort(key=lambda item: item[1].rank)  # type: ignore[arg-type, return-value]
    return ranked


def token_bytes(text: str) -> list[int]:
    # The UTF-8 of the decoded token: exact for whole characters; a token holding part of a
    # multi-byte character decodes to U+FFFD, whose bytes are what is reported then.
    return list(text.encode("utf-8"))
