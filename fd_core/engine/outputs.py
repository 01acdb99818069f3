"""What the engine returns for a request (vLLM's shapes, so client code carries over)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request's tokens arrived, for latency metrics. Times are ``time.monotonic()`` of
    the process reading the outputs (the engine client's); durations are seconds, measured by the
    engine core on its own clock. ``None``: not yet, or not known."""

    first_token_time: float | None = None  # the request's first token arrived
    last_token_time: float | None = None  # the step that produced this output's newest tokens arrived
    time_in_queue: float | None = None  # the core held the request before it first scheduled it
    prefill_time: float | None = None  # from that scheduling to the first token, in the core
    # this output only (not cumulative): for each sequence that got a token after its first one,
    # the seconds since its previous token arrived
    inter_token_latencies: list[float] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None  # set by the engine client of ``fd serve``; None offline
    # with SamplingParams.prompt_logprobs, once the first token is out: None for the first prompt
    # token, then per prompt token {token id: Logprob} holding it and the top k of its position
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
