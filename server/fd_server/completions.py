"""POST /v1/completions.

A request with several prompts runs them together; choice ``index`` is
``prompt_position * n + sample``, as with OpenAI. ``text_offset`` counts characters of the
returned text (so, with ``echo``, the first generated token starts after the prompt). ``echo``
with ``logprobs`` starts the logprobs with the prompt's tokens, the first without a logprob (as
OpenAI's legacy completions and vLLM); ``prompt_logprobs`` (vLLM's) come in each choice, in a
stream in the choice's first chunk with the echoed prompt.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from fd_core.engine.detokenizer import stop_holdback
from fd_core.engine.outputs import Logprob, RequestOutput
from fd_server import params as P
from fd_server import refused
from fd_server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
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
    token_text,
    top_entries,
)
from fd_server.structured import structured_outputs

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create(ctx: ServerContext, body: CompletionRequest, request: Request) -> Any:
    arrival = time.monotonic()
    P.check_model(body, ctx.model_names)
    refused.check(body)
    client = ctx.client
    prompts = await ctx.offload(P.completion_prompts, body, ctx.tokenizer, client.max_model_len,
                                ctx.max_sequences_per_request)
    max_tokens = body.max_tokens if "max_tokens" in body.model_fields_set else None
    constraint = await ctx.offload(structured_outputs, body)  # compiling a grammar may take a while
    plan = []
    for text, ids in prompts:  # everything is checked before anything is submitted
        P.check_prompt(client, ids, "prompt")
        sampling = P.sampling_params(
            client, body, prompt_len=len(ids),
            max_tokens=max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS, logprobs=body.logprobs,
            constraint=constraint, prompt_logprobs=P.prompt_logprobs(body, body.logprobs if body.echo else None))
        plan.append((text, ids, sampling))
    batch = Batch(ctx.monitor, new_id("cmpl"), arrival, ctx.request_timeout, ctx.log_requests)
    for text, ids, sampling in plan:
        batch.submit(ids, sampling, text, body.cache_salt)
    echoes = [_echo(ctx, text, ids) if body.echo else "" for text, ids in prompts]
    if body.stream:
        return SSEResponse(_events(ctx, body, batch, echoes), on_close=batch.close)
    outputs = await batch.final(request)
    ids = body.return_token_ids
    choices = []
    for p, output in enumerate(outputs):
        scores = prompt_logprobs(body, output)
        for o in output.outputs:
            if body.echo and body.logprobs is not None:
                logprobs = _logprobs(output.prompt_token_ids + o.token_ids, _prompt_steps(output) + o.logprobs,
                                     body.logprobs, ctx.tokenizer, 0)
            else:
                logprobs = _logprobs(o.token_ids, o.logprobs, body.logprobs, ctx.tokenizer, len(echoes[p]))
            choices.append(CompletionChoice(
                index=p * body.n + o.index,
                text=echoes[p] + o.text,
                logprobs=logprobs,
                finish_reason=o.finish_reason,
                prompt_logprobs=scores,
                prompt_token_ids=list(output.prompt_token_ids) if ids else None,
                token_ids=list(o.token_ids) if ids else None,
            ))
    return CompletionResponse(id=batch.base_id, model=ctx.model_name, choices=choices, usage=_usage(outputs))


def _prompt_steps(output: RequestOutput) -> list[dict[int, Logprob] | None]:
    """The echoed prompt's logprobs, one per token (None for the first, and for every token of
    a request that ended before its prompt was scored)."""
    return output.prompt_logprobs or [None] * len(output.prompt_token_ids)


def _echo(ctx: ServerContext, text: str | None, ids: list[int]) -> str:
    return text if text is not None else ctx.tokenizer.decode(ids, skip_special_tokens=False)


def _usage(outputs: list[Any]) -> UsageInfo:
    """Usage of all the prompts; each prompt (and what the prefix cache held of it) counts once,
    whatever ``n``."""
    done = [o for o in outputs if o is not None]
    prompt = sum(len(o.prompt_token_ids) for o in done)
    completion = sum(len(c.token_ids) for o in done for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in done)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _logprobs(token_ids: list[int], steps: list[dict[int, Logprob] | None] | None, k: int | None, tokenizer: Any,
              offset: int) -> CompletionLogprobs | None:
    """OpenAI's legacy logprobs of ``token_ids`` (``steps``: their engine logprobs; None for an
    echoed prompt's first token, which nothing before it predicts), text offsets from ``offset``."""
    if k is None or steps is None:
        return None
    result = CompletionLogprobs()
    for tid, step in zip(token_ids, steps):
        entry = (step.get(tid) if step is not None else None) or Logprob(float("nan"))
        text = token_text(entry, tid, tokenizer)
        result.tokens.append(text)
        if step is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(safe_logprob(entry.logprob))
            # as OpenAI: the k most likely, plus the sampled token when it is not among them
            tops = {token_text(lp, t, tokenizer): safe_logprob(lp.logprob) for t, lp in top_entries(step, k)}
            tops.setdefault(text, safe_logprob(entry.logprob))
            result.top_logprobs.append(tops)
        result.text_offset.append(offset)
        offset += len(text)
    return result


async def _events(ctx: ServerContext, body: CompletionRequest, batch: Batch, echoes: list[str]) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        payload = CompletionChunk(id=batch.base_id, created=created, model=ctx.model_name, choices=choices,
                                  usage=usage)
        return sse(payload.model_dump_json(exclude=None if include_usage else {"usage"}))

    total = len(batch.streams) * n
    ids = body.return_token_ids
    sent_chars = [0] * total
    sent_tokens = [0] * total
    offsets = [len(echoes[i // n]) for i in range(total)]
    finished = [False] * total
    echo_logprobs = body.echo and body.logprobs is not None
    # the prompt's logprobs (echoed, or prompt_logprobs) come with the first token: the choice's
    # first chunk waits for them
    waiting = [echo_logprobs or body.prompt_logprobs is not None] * total
    # return_token_ids: the prompt's ids go in the choice's first chunk
    prompt_ids = [batch.streams[i // n].prompt_token_ids if ids else None for i in range(total)]
    for i in range(total):
        if echoes[i // n] and not echo_logprobs:
            yield chunk([CompletionChoice(index=i, text=echoes[i // n], prompt_token_ids=prompt_ids[i])])
            prompt_ids[i] = None
    async for changes in batch.updates():
        for p, output in changes:
            stops = batch.streams[p].params.stop_strings
            for o in output.outputs:
                i = p * n + o.index
                if finished[i]:
                    continue
                done = o.finish_reason is not None
                if waiting[i]:
                    if output.prompt_logprobs is None and not done:
                        continue
                    waiting[i] = False
                    lps = None
                    if echo_logprobs:
                        lps = _logprobs(output.prompt_token_ids, _prompt_steps(output), body.logprobs, ctx.tokenizer, 0)
                        offsets[i] = sum(len(t) for t in lps.tokens)
                    scores = prompt_logprobs(body, output)
                    yield chunk([CompletionChoice(index=i, text=echoes[p] if echo_logprobs else "", logprobs=lps,
                                                  prompt_logprobs=scores, prompt_token_ids=prompt_ids[i])])
                    prompt_ids[i] = None
                limit = len(o.text) if done else len(o.text) - stop_holdback(o.text, stops)
                delta = o.text[sent_chars[i]:limit] if limit > sent_chars[i] else ""
                new_ids = o.token_ids[sent_tokens[i]:]
                if not (delta or done or (body.logprobs is not None and new_ids)):
                    continue
                steps = o.logprobs[sent_tokens[i]:] if o.logprobs is not None else None
                lps = _logprobs(new_ids, steps, body.logprobs, ctx.tokenizer, offsets[i])
                if lps is not None:
                    offsets[i] += sum(len(t) for t in lps.tokens)
                sent_chars[i] = max(sent_chars[i], limit)
                sent_tokens[i] = len(o.token_ids)
                finished[i] = done
                yield chunk([CompletionChoice(index=i, text=delta, logprobs=lps, finish_reason=o.finish_reason,
                                              prompt_token_ids=prompt_ids[i], token_ids=new_ids if ids else None)])
                prompt_ids[i] = None
    if include_usage:
        yield chunk([], _usage([s.latest for s in batch.streams]))
