"""From an OpenAI request to what the engine takes: prompt token ids and SamplingParams.

``max_tokens``: when the client gives none, a chat request may use the rest of the context
window and a completion request 16 tokens (OpenAI's default), cut to what fits. When the client
gives one that does not fit beside the prompt, the request is refused (400,
``context_length_exceeded``) as OpenAI does, rather than silently shortened.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fd_core.engine.prompts import encode_prompt
from fd_core.engine.sampling_params import SamplingParams
from fd_core.errors import InvalidRequestError, PromptTooLongError
from fd_server.errors import APIError, bad_request
from fd_server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from fd_server.structured import Constraint


def check_model(request: SamplingFields, served_model_names: Sequence[str]) -> None:
    if request.model not in served_model_names:
        raise model_not_found(request.model, served_model_names)


def model_not_found(model: str, served_model_names: Sequence[str]) -> APIError:
    names = " or ".join(repr(n) for n in served_model_names)
    return APIError(404, f"The model {model!r} does not exist; this server serves {names}.",
                    param="model", code="model_not_found")


def check_prompt(client: Any, token_ids: list[int], param: str) -> None:
    try:
        client.check_prompt(token_ids)
    except PromptTooLongError as exc:
        raise bad_request(str(exc), param=param, code="context_length_exceeded") from exc
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=param) from exc


def truncated(request: SamplingFields, token_ids: list[int], max_model_len: int) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` tokens (vLLM's: -1 keeps the last
    max_model_len), or the prompt as it is when the field is unset or the prompt shorter."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return token_ids
    if keep == 0 or keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 (the model's context, {max_model_len} tokens) or "
                          f"between 1 and {max_model_len}, got {keep}.", param="truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:] if len(token_ids) > keep else token_ids


def prompt_logprobs(request: SamplingFields, echoed: int | None = None) -> int | None:
    """How many top logprobs of each prompt token the engine computes: the request's
    ``prompt_logprobs``, and ``echoed`` (completions' ``echo`` with ``logprobs``, whose answer
    starts with the prompt's tokens), the more of the two, as vLLM."""
    asked = request.prompt_logprobs
    if asked is None or asked < 0:  # a refusal names the request's own field
        return echoed if asked is None else asked
    return asked if echoed is None else max(asked, echoed)


def sampling_params(client: Any, request: SamplingFields, *, prompt_len: int,
                    max_tokens: int | None, default_max_tokens: int | None, logprobs: int | None,
                    logprobs_param: str = "logprobs", constraint: Constraint | None = None,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams for one prompt of ``prompt_len`` tokens (already checked to fit);
    ``logprobs_param``: the request field ``logprobs`` came from; ``constraint``: the
    request's structured output (``fd_server.structured``); ``prompt_logprobs``: see the
    function of that name."""
    max_model_len = client.max_model_len
    room = max_model_len - prompt_len
    min_tokens = request.min_tokens
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        min_tokens = min(min_tokens, max_tokens)  # a default must not make a valid request invalid
    elif max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} "
            f"and {max_tokens} were asked for the completion. Ask for at most {room}.",
            param="max_tokens", code="context_length_exceeded")
    try:
        params = SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=request.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=constraint.params if constraint is not None else None,
            allowed_token_ids=request.allowed_token_ids, bad_words=request.bad_words,
            logit_bias=request.logit_bias or None,
        )
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param) from exc
    try:
        client.check_params(params)  # the core's own check: the vocabulary, --max-logprobs, the backend
    except InvalidRequestError as exc:
        param = exc.param
        if param == "logprobs":
            param = logprobs_param
        elif param == "prompt_logprobs" and request.prompt_logprobs is None:
            param = "echo"  # completions' echo with logprobs asked for them
        elif param == "structured_outputs" and constraint is not None:
            param = constraint.field  # response_format, guided_json, tool_choice...
        raise bad_request(str(exc), param=param) from exc
    return params


# -- chat ------------------------------------------------------------------------------------


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template sees them: text parts joined, ``None`` keys dropped."""
    messages = []
    for i, message in enumerate(request.messages):
        item = message.model_dump(exclude_none=True)
        if message.content is None:
            # OpenAI lets an assistant message carry tool_calls instead of content (as null);
            # templates concatenate content, so they get an empty one. Any other role must speak.
            if message.role != "assistant":
                raise bad_request(f"messages[{i}].content is required for a {message.role!r} message.",
                                  param=f"messages.{i}.content")
            item["content"] = ""
        elif isinstance(message.content, list):
            texts = []
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content: only text parts are supported, got {part.type!r}.",
                                      param=f"messages.{i}.content")
                texts.append(part.text)
            item["content"] = "\n".join(texts)
        messages.append(item)
    return messages


def chat_prompt(request: ChatCompletionRequest, tokenizer: Any, max_model_len: int,
                tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true.", param="top_logprobs")
    messages = chat_messages(request)
    kwargs = dict(request.chat_template_kwargs or {})
    # vLLM's top-level fields for the template; the request's kwargs win, as there
    for name in ("documents", "reasoning_effort"):
        if getattr(request, name) is not None:
            kwargs.setdefault(name, getattr(request, name))
    if "chat_template" in kwargs:
        # a template is code: clients pick variables of the model's template, not a new one
        raise bad_request("chat_template_kwargs may not replace the chat template.", param="chat_template_kwargs")
    try:
        if tools:
            kwargs["tools"] = tools
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                             continue_final_message=request.continue_final_message, **kwargs)
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=exc.param or "messages") from exc
    except Exception as exc:  # a template failing on what this conversation holds
        raise bad_request(f"The chat template could not render these messages: {exc}", param="messages") from exc
    if not isinstance(text, str):
        raise bad_request("The chat template did not produce text.", param="messages")
    # the template already placed any BOS the model wants (add_special_tokens: another, as vLLM)
    cut = request.truncate_prompt_tokens is not None
    ids = _encode(tokenizer, text, None if cut else max_model_len, "messages",
                  add_special_tokens=bool(request.add_special_tokens))
    kept = truncated(request, ids, max_model_len)
    return (text if kept is ids else tokenizer.decode(kept, skip_special_tokens=False)), kept


def chat_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        return None
    return request.top_logprobs or 0


# -- completions -----------------------------------------------------------------------------


def completion_prompts(request: CompletionRequest, tokenizer: Any, max_model_len: int,
                       max_sequences: int | None = None) -> list[tuple[str | None, list[int]]]:
    """The request's prompts as (text or None, token ids), in order; at most ``max_sequences``
    prompts × n."""
    if request.suffix:
        raise bad_request("suffix is not supported by this server.", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of other than n is not supported by this server.", param="best_of")
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty.", param="prompt")
    check_sequences(len(items), request.n, max_sequences)
    prompts: list[tuple[str | None, list[int]]] = []
    cut = request.truncate_prompt_tokens is not None
    for i, item in enumerate(items):
        if isinstance(item, str):
            field = "prompt" if len(items) == 1 else f"prompt.{i}"
            ids = _encode(tokenizer, item, None if cut else max_model_len, field,
                          add_special_tokens=request.add_special_tokens is not False)
        else:
            item, ids = None, list(item)
        kept = truncated(request, ids, max_model_len)
        prompts.append((item if kept is ids else None, kept))  # a cut prompt's text is its tokens'
    return prompts


def check_sequences(num_prompts: int, n: int, max_sequences: int | None) -> None:
    """One request may not ask for more than ``max_sequences`` sequences (prompts × n): the
    engine would run them all, and an 800-byte body could otherwise ask for thousands."""
    if max_sequences is not None and num_prompts * n > max_sequences:
        raise bad_request(
            f"This request asks for {num_prompts} prompt(s) × n={n} = {num_prompts * n} sequences; this server "
            f"takes at most {max_sequences} per request (--max-sequences-per-request). Split it into several requests.",
            param="n" if num_prompts == 1 else "prompt")


def _encode(tokenizer: Any, text: str, max_model_len: int | None, field: str, add_special_tokens: bool) -> list[int]:
    try:
        return encode_prompt(tokenizer, text, max_model_len, field, add_special_tokens=add_special_tokens)
    except PromptTooLongError as exc:
        raise bad_request(str(exc), param=field, code="context_length_exceeded") from exc
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param=field) from exc
