"""Request fields of OpenAI's and vLLM's APIs that would change the output and that fd does
not honour. Unknown fields are ignored (clients written for newer APIs keep working), so these
are named in the schema and refused here when they hold anything but their neutral value: a
client that asks for beam search must hear that it did not get it, not read a 200."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fd_server.errors import bad_request
from fd_server.protocol import ChatCompletionRequest


def _off(neutral: tuple[Any, ...]) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == n and type(value) is type(n) for n in neutral)


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


_NOT_SUPPORTED = "is not supported by this server"

Rule = tuple[Callable[[Any], bool], str]  # (whether a value asks nothing of the server, why it is refused)

SHARED: dict[str, Rule] = {
    "use_beam_search": (_off((False,)), f"beam search {_NOT_SUPPORTED}"),
    "length_penalty": (_off((1, 1.0)), f"length_penalty applies to beam search, which {_NOT_SUPPORTED}"),
    "logits_processors": (_empty, f"logits_processors {_NOT_SUPPORTED}"),
    "spaces_between_special_tokens": (_off((True,)), f"spaces_between_special_tokens=false {_NOT_SUPPORTED}"),
    "return_tokens_as_token_ids": (_off((False,)), f"return_tokens_as_token_ids {_NOT_SUPPORTED}"),
    "priority": (_off((0,)), "priority scheduling is not supported: this server schedules first come, first served"),
    "kv_transfer_params": (_empty, f"disaggregated prefill (kv_transfer_params) {_NOT_SUPPORTED}"),
    "vllm_xargs": (_empty, f"vllm_xargs {_NOT_SUPPORTED}"),
    "mm_processor_kwargs": (_empty, f"multimodal input {_NOT_SUPPORTED}"),
    "media_io_kwargs": (_empty, f"multimodal input {_NOT_SUPPORTED}"),
}
COMPLETIONS: dict[str, Rule] = {
    "prompt_embeds": (_empty, f"prompt_embeds {_NOT_SUPPORTED}: send text or token ids"),
}
CHAT: dict[str, Rule] = {
    "functions": (_empty, "functions is the deprecated form of tools: send tools (and tool_choice) instead"),
    "function_call": (_off(()), "function_call is the deprecated form of tool_choice: send tools and tool_choice instead"),
    "audio": (_off(()), f"audio output {_NOT_SUPPORTED}"),
    "modalities": (lambda v: v is None or v == ["text"], f"output modalities other than text are {_NOT_SUPPORTED[3:]}"),
    "web_search_options": (_off(()), f"web search {_NOT_SUPPORTED}"),
    "verbosity": (_off(()), f"verbosity {_NOT_SUPPORTED}"),
    "chat_template": (_off(()), ("a request may not bring its own chat template: this server uses the model's"
                                " (or --chat-template)")),
}


def check(request: Any) -> None:
    """A 400 naming the first field of ``request`` (a chat or completion request) that asks for
    something this server does not do."""
    own = CHAT if isinstance(request, ChatCompletionRequest) else COMPLETIONS
    for name in request.model_fields_set:
        rule = SHARED.get(name) or own.get(name)
        if rule is not None and not rule[0](getattr(request, name)):
            raise bad_request(f"{rule[1]}.", param=name)
