"""POST /v1/chat/completions."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request

from fd_core.engine.detokenizer import stop_holdback
from fd_core.engine.outputs import CompletionOutput, Logprob
from fd_server import params as P
from fd_server import refused
from fd_server.parsers import ReasoningParser
from fd_server.protocol import (
    AssistantMessage,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatStreamChoice,
    DeltaMessage,
    PromptLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from fd_server.serving import (
    Batch,
    ServerContext,
    SSEResponse,
    new_id,
    prompt_logprobs,
    safe_logprob,
    sse,
    token_bytes,
    token_text,
    top_entries,
)
from fd_server.structured import structured_outputs
from fd_server.tools import ToolPlan, plan


async def create(ctx: ServerContext, body: ChatCompletionRequest, request: Request) -> Any:
    arrival = time.monotonic()
    P.check_model(body, ctx.model_names)
    refused.check(body)
    P.check_sequences(1, body.n, ctx.max_sequences_per_request)
    client = ctx.client
    constraint = await ctx.offload(structured_outputs, body)  # compiling a grammar may take a while
    tools = await ctx.offload(plan, body, ctx.parsing, constraint is not None)
    if tools is not None and tools.constraint is not None:
        constraint = tools.constraint  # tool_choice required or named
    prompt_text, prompt_ids = await ctx.offload(P.chat_prompt, body, ctx.tokenizer, client.max_model_len,
                                                tools.tools if tools is not None else None)
    P.check_prompt(client, prompt_ids, "messages")
    logprobs = P.chat_logprobs(body)
    # response_format and a required or named tool choice describe the answer: with a reasoning
    # parser and thinking on, their grammar holds once the thought has ended (as vLLM's); with
    # thinking off, from the first token, and there is no reasoning to split off. A grammar given
    # as structured_outputs or guided_* describes the whole output, thought included.
    reasoning, thinking = ctx.parsing.reasoning(), _thinking(body)
    answer_only = constraint is not None and constraint.field in ("response_format", "tool_choice")
    if answer_only and reasoning is not None:
        if thinking:
            constraint = constraint.after(reasoning.end)
        else:
            reasoning = None
    sampling = P.sampling_params(
        client, body, prompt_len=len(prompt_ids),
        max_tokens=body.max_completion_tokens or body.max_tokens, default_max_tokens=None, logprobs=logprobs,
        logprobs_param="top_logprobs", constraint=constraint, prompt_logprobs=P.prompt_logprobs(body))
    reader = Reader(reasoning, tools, thinking, body.include_reasoning, _echoed(body))
    batch = Batch(ctx.monitor, new_id("chatcmpl"), arrival, ctx.request_timeout, ctx.log_requests)
    batch.submit(prompt_ids, sampling, prompt_text, body.cache_salt)
    if body.stream:
        return SSEResponse(_events(ctx, body, batch, prompt_ids, logprobs, reader), on_close=batch.close)
    (output,) = await batch.final(request)
    ids = body.return_token_ids
    choices = []
    for o in output.outputs:
        message, finish = reader.message(o.text, o.finish_reason)
        choices.append(ChatCompletionChoice(index=o.index, message=message, finish_reason=finish,
                                            logprobs=_logprobs(o.token_ids, o.logprobs, logprobs, ctx.tokenizer),
                                            token_ids=list(o.token_ids) if ids else None))
    completion = sum(len(o.token_ids) for o in output.outputs)
    return ChatCompletionResponse(id=batch.base_id, model=ctx.model_name, choices=choices,
                                  usage=_usage(len(prompt_ids), completion, output.num_cached_tokens),
                                  prompt_logprobs=prompt_logprobs(body, output),
                                  prompt_token_ids=list(prompt_ids) if ids else None)


def _echoed(body: ChatCompletionRequest) -> str:
    """What a reply begins with under ``echo``: the last message's text where the assistant
    wrote it (a reply continued with continue_final_message), else nothing, as vLLM does."""
    if not body.echo or body.messages[-1].role != "assistant":
        return ""
    return P.chat_messages(body)[-1]["content"]  # the text the template saw


def _thinking(body: ChatCompletionRequest) -> bool:
    """Whether the request leaves the model's thinking on (Qwen3's ``enable_thinking``)."""
    return (body.chat_template_kwargs or {}).get("enable_thinking", True) is not False


class Reader:
    """Turns a choice's text into the assistant message: reasoning split off first
    (``--reasoning-parser``), then tool calls read from what follows (the request's tool plan)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolPlan | None, thinking: bool,
                 include_reasoning: bool = True, echoed: str = "") -> None:
        self.reasoning, self.thinking = reasoning, thinking
        self.tools = tools.parser if tools is not None else None
        self.include_reasoning = include_reasoning  # false: the thought is split off and dropped
        self.echoed = echoed  # the content a reply begins with (echo)

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text, self.thinking)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.parse(content or "")
        if self.echoed:
            content = self.echoed + (content or "")
        message = AssistantMessage(content=content, reasoning_content=reasoning if self.include_reasoning else None,
                                   tool_calls=[c.to_openai() for c in calls])
        return message, "tool_calls" if calls else finish_reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One choice's text as it arrives, as deltas: reasoning, content, tool-call pieces."""

    def __init__(self, reader: Reader) -> None:
        self.reasoning = reader.reasoning.stream(reader.thinking) if reader.reasoning is not None else None
        self.tools = reader.tools.stream() if reader.tools is not None else None
        self.include_reasoning = reader.include_reasoning

    def feed(self, delta: str, done: bool) -> tuple[str, str, list[dict]]:
        reasoning, content = ("", delta) if self.reasoning is None else self.reasoning.feed(delta)
        if done and self.reasoning is not None:
            more_r, more_c = self.reasoning.finish()
            reasoning, content = reasoning + more_r, content + more_c
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if done:
                more, more_calls = self.tools.finish()
                content, calls = content + more, calls + more_calls
        return reasoning if self.include_reasoning else "", content, [c.to_openai() for c in _merged(calls)]

    @property
    def called(self) -> bool:
        return self.tools is not None and bool(self.tools.calls)


def _merged(deltas: list) -> list:
    """One delta per call index (a step may add to the same call twice)."""
    out: dict[int, Any] = {}
    for d in deltas:
        if d.index in out:
            out[d.index].arguments += d.arguments
        else:
            out[d.index] = d
    return list(out.values())


def _usage(prompt: int, completion: int, cached: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _logprobs(token_ids: list[int], steps: list[dict[int, Logprob]] | None, k: int | None,
              tokenizer: Any) -> ChatChoiceLogprobs | None:
    if k is None or steps is None:
        return None
    content = []
    for tid, step in zip(token_ids, steps):
        entry = step.get(tid) or Logprob(float("nan"))
        text = token_text(entry, tid, tokenizer)
        tops = []
        for top_id, top in top_entries(step, k):
            top_text = token_text(top, top_id, tokenizer)
            tops.append(TopLogprob(token=top_text, logprob=safe_logprob(top.logprob), bytes=token_bytes(top_text)))
        content.append(ChatLogprob(token=text, logprob=safe_logprob(entry.logprob), bytes=token_bytes(text),
                                   top_logprobs=tops))
    return ChatChoiceLogprobs(content=content)


async def _events(ctx: ServerContext, body: ChatCompletionRequest, batch: Batch, prompt_ids: list[int],
                  logprobs: int | None, reader: Reader) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    stops = batch.streams[0].params.stop_strings

    ids = body.return_token_ids

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None,
              scores: PromptLogprobs | None = None, prompt: list[int] | None = None) -> str:
        payload = ChatCompletionChunk(id=batch.base_id, created=created, model=ctx.model_name,
                                      choices=choices, usage=usage, prompt_logprobs=scores, prompt_token_ids=prompt)
        return sse(payload.model_dump_json(exclude=None if include_usage else {"usage"}))

    def roles(scores: PromptLogprobs | None = None) -> Iterator[str]:
        for i in range(body.n):  # the first chunk carries what belongs to the prompt
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=reader.echoed))],
                        scores=scores if i == 0 else None, prompt=list(prompt_ids) if ids and i == 0 else None)

    # prompt_logprobs come with the first token: then the first chunk, which carries them
    waiting = body.prompt_logprobs is not None
    if not waiting:
        for event in roles():
            yield event
    sent_chars = [0] * body.n
    sent_tokens = [0] * body.n
    last: list[CompletionOutput | None] = [None] * body.n
    finished = [False] * body.n
    streams = [reader.stream() for _ in range(body.n)]
    async for changes in batch.updates():
        if waiting:
            output = changes[0][1]
            if output.prompt_logprobs is None and not output.finished:
                continue
            waiting = False
            for event in roles(prompt_logprobs(body, output)):
                yield event
        for _, output in changes:
            for o in output.outputs:
                i = o.index
                if finished[i]:
                    continue
                last[i] = o
                done = o.finish_reason is not None
                limit = len(o.text) if done else len(o.text) - stop_holdback(o.text, stops)
                delta = o.text[sent_chars[i]:limit] if limit > sent_chars[i] else ""
                new_ids = o.token_ids[sent_tokens[i]:]
                new_steps = o.logprobs[sent_tokens[i]:] if o.logprobs is not None else None
                if not (delta or done or (logprobs is not None and new_ids)):
                    continue
                sent_chars[i] = max(sent_chars[i], limit)
                sent_tokens[i] = len(o.token_ids)
                finished[i] = done
                reasoning, content, calls = streams[i].feed(delta, done)
                if not (reasoning or content or calls or done or ((logprobs is not None or ids) and new_ids)):
                    continue  # held back by a parser (a tag's first characters)
                finish = "tool_calls" if done and streams[i].called else o.finish_reason
                yield chunk([ChatStreamChoice(
                    index=i,
                    delta=DeltaMessage(content=content if content or not (reasoning or calls) else None,
                                       reasoning_content=reasoning or None, tool_calls=calls or None),
                    logprobs=_logprobs(new_ids, new_steps, logprobs, ctx.tokenizer),
                    finish_reason=finish,
                    token_ids=list(new_ids) if ids else None,
                )])
    if include_usage:
        completion = sum(len(o.token_ids) for o in last if o is not None)
        latest = batch.streams[0].latest
        yield chunk([], _usage(len(prompt_ids), completion, latest.num_cached_tokens if latest is not None else 0))
