"""OutputProcessor: turns the core's token-level outputs into RequestOutputs with text.

It lives in the front end (the HTTP process in ``fd serve``, the caller's process for the
offline ``LLM``): detokenization, stop strings and the decoded form of logprobs happen here.
A stop string ends a sequence on this side, so the processor reports which sequences the
core should abort.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fd_core.engine import detokenizer
from fd_core.engine.core import CoreOutput, PromptLogprobs
from fd_core.engine.detokenizer import TextState
from fd_core.engine.outputs import (
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from fd_core.engine.sampling_params import SamplingParams
from fd_core.loader.tokenizer_api import Tokenizer


@dataclass
class _Output:
    state: TextState
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_token_time: float | None = None


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    outputs: list[_Output]
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # when the caller times the outputs (``now``)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        outputs = [_Output(TextState(prompt_token_ids, params)) for _ in range(params.n)]
        self.requests[request_id] = _Request(request_id, prompt, prompt_token_ids, params, outputs)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request; returns its last state with unfinished outputs marked ``abort``."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for o in request.outputs:
            detokenizer.catch_up(self.tokenizer, o.state)  # tokens a final_only step left unread
            if o.finish_reason is None:
                o.finish_reason = "abort"
        return self._snapshot(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process(self, core_outputs: list[CoreOutput], final_only: bool = False,
                now: float | None = None) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """Apply one step's outputs. Returns the outputs of requests that changed (with
        ``final_only``, of requests that finished: a caller that waits for whole results skips
        a snapshot per request per step), and the ``(request_id, index)`` sequences a stop
        string ended, which the core must abort. ``now``: when the step's outputs arrived
        (``time.monotonic()``); given, each output carries ``RequestMetrics``."""
        touched: dict[str, _Request] = {}
        gaps: dict[str, list[float]] = {}
        to_abort: list[tuple[str, int]] = []
        unread: list[TextState] = []  # decoded together after the loop
        for co in core_outputs:
            request = self.requests.get(co.request_id)
            if request is None:
                continue  # aborted here while the core was still computing it
            out = request.outputs[co.index]
            if out.finish_reason is not None:
                continue
            if co.index == 0:
                request.num_cached_tokens = co.num_cached_tokens
                if co.prompt_logprobs is not None:
                    request.prompt_logprobs = self._prompt_logprobs(request.prompt_token_ids, co.prompt_logprobs)
            if now is not None:
                self._time(request, out, co, now, gaps)
            state = out.state
            params = request.params
            if not params.stop_strings:  # the tokens at once: no text can end the output among them
                state.output_token_ids.extend(co.token_ids)
                out.cumulative_logprob += co.logprob
                if params.logprobs is not None:
                    out.logprobs.extend(self._logprobs(co, i) for i in range(len(co.token_ids)))
                if co.finish_reason is not None:
                    out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
                elif final_only:
                    continue  # nobody reads the text before the end: decode it once then
                unread.append(state)
                touched[co.request_id] = request
                continue
            last = len(co.token_ids) - 1
            for i, token in enumerate(co.token_ids):  # a stop string may end the text at any of them
                state.output_token_ids.append(token)
                out.cumulative_logprob += co.logprobs[i]
                if params.logprobs is not None:
                    out.logprobs.append(self._logprobs(co, i))
                new_text = detokenizer.catch_up(self.tokenizer, state)
                if i == last and co.finish_reason is not None:
                    out.finish_reason, out.stop_reason = co.finish_reason, co.stop_reason
                elif len(state.output_token_ids) >= params.min_tokens:
                    stop = detokenizer.find_stop(state, len(new_text))
                    if stop is not None:
                        out.finish_reason, out.stop_reason = "stop", stop
                        to_abort.append((co.request_id, co.index))
                        break
            touched[co.request_id] = request
        detokenizer.catch_up_all(self.tokenizer, unread)
        results = []
        for rid, request in touched.items():
            finished = request.finished
            if finished or not final_only:
                results.append(self._snapshot(request, finished, gaps.get(rid)))
            if finished:
                self.requests.pop(rid, None)
        return results, to_abort

    @staticmethod
    def _time(request: _Request, out: _Output, co: CoreOutput, now: float, gaps: dict[str, list[float]]) -> None:
        m = request.metrics
        if m is None:
            m = request.metrics = RequestMetrics(first_token_time=now)
        m.last_token_time = now
        if co.time_in_queue is not None and m.time_in_queue is None:
            m.time_in_queue, m.prefill_time = co.time_in_queue, co.prefill_time
        if out.last_token_time is not None:
            gaps.setdefault(co.request_id, []).append(now - out.last_token_time)
        if len(co.token_ids) > 1:  # a round's tokens arrive together: no gap between them
            gaps.setdefault(co.request_id, []).extend([0.0] * (len(co.token_ids) - 1))
        out.last_token_time = now

    def _logprobs(self, co: CoreOutput, i: int) -> dict[int, Logprob]:
        """The ``i``-th token's entry."""
        return self._entry(co.token_ids[i], co.logprobs[i], co.ranks[i], co.top[i] if co.top else [])

    def _entry(self, token_id: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """A token's Logprob and those of the best ``top`` of its position, decoded."""
        # no tokenizer (skip_tokenizer_init): the tokens' ids, no text
        decode = self.tokenizer.decode if self.tokenizer is not None else (lambda ids, **_: None)
        entry = {token_id: Logprob(logprob, rank, decode([token_id], skip_special_tokens=False))}
        for place, (tid, lp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, place, decode([tid], skip_special_tokens=False))
        return entry

    def _prompt_logprobs(self, prompt: list[int], scores: PromptLogprobs) -> list[dict[int, Logprob] | None]:
        """vLLM's shape: None for the first prompt token, then one entry per token."""
        return [None] + [self._entry(token, lp, rank, top) for token, lp, rank, top
                         in zip(prompt[1:], scores.logprobs, scores.ranks, scores.top)]

    @staticmethod
    def _snapshot(request: _Request, finished: bool | None = None,
                  gaps: list[float] | None = None) -> RequestOutput:
        outs = [
            CompletionOutput(
                index=i, text=o.state.text, token_ids=list(o.state.output_token_ids),
                cumulative_logprob=o.cumulative_logprob,
                logprobs=list(o.logprobs) if request.params.logprobs is not None else None,
                finish_reason=o.finish_reason, stop_reason=o.stop_reason,
            )
            for i, o in enumerate(request.outputs)
        ]
        finished = request.finished if finished is None else finished
        m = request.metrics
        metrics = None if m is None else RequestMetrics(m.first_token_time, m.last_token_time, m.time_in_queue,
                                                        m.prefill_time, gaps or [])
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs,
                             finished, request.num_cached_tokens, metrics, request.prompt_logprobs)
