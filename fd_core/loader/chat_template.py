"""Rendering a model's own chat template, the way Hugging Face tokenizers do.

Templates ship inside checkpoints we did not write, so they run in Jinja's immutable sandbox.
The environment mirrors what templates are written against in the wild: ``trim_blocks`` and
``lstrip_blocks``, loop controls, a ``tojson`` that leaves non-ASCII text alone, the
``raise_exception`` and ``strftime_now`` globals and the ``{% generation %}`` block tag.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fd_core.errors import CheckpointError, InvalidRequestError


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; here it only renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own filter HTML-escapes, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def select_template(templates: str | Mapping[str, str] | None, choice: str | None = None, tools: object = None) -> str:
    """The template to render with.

    ``choice`` names one of several templates a checkpoint ships, or is itself a template (any text
    with a ``{``). Without it, a checkpoint with named templates uses ``tool_use`` when tools are
    given, else ``default``, as Hugging Face tokenizers do.
    """
    if choice is not None:
        if isinstance(templates, Mapping) and choice in templates:
            return templates[choice]
        if "{" in choice:
            return choice
        raise InvalidRequestError(f"The model has no chat template named {choice!r}.")
    if templates is None:
        raise InvalidRequestError(
            "This model has no chat template; send a plain completion request or give it a template."
        )
    if isinstance(templates, str):
        return templates
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise InvalidRequestError(
        f"The model has several chat templates and none is called 'default'; pick one of {sorted(templates)}."
    )


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    special_tokens: Mapping[str, str | None] | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with ``template``.

    ``special_tokens`` (``bos_token``, ``eos_token``...) are visible to the template as variables,
    and ``kwargs`` override them, as in ``transformers``. Keys whose value is ``None`` are dropped from
    each message first: OpenAI-style clients send ``content=None`` that templates would print.
    ``continue_final_message``: the text ends with the last message's content, left open (what
    the template puts after it, such as an end-of-turn token, is cut), so that the model goes on
    with it: a prefilled reply.
    """
    if not messages:
        raise InvalidRequestError("A chat request needs at least one message.")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: set "
                                  "add_generation_prompt to false to continue the last message.",
                                  param="continue_final_message")
    cleaned = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"Each chat message must be a mapping with a role and content, not {message!r}.")
        cleaned.append({key: value for key, value in message.items() if value is not None})
    variables = {key: value for key, value in (special_tokens or {}).items() if value is not None}
    variables.update(kwargs)
    try:
        text = _compile(template).render(
            messages=cleaned,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise CheckpointError(f"The model's chat template does not parse: {exc}.") from exc
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequestError(f"The model's chat template rejected this conversation: {exc}.") from exc
    return _left_open(text, cleaned[-1]) if continue_final_message else text


def _left_open(text: str, final: Mapping[str, Any]) -> str:
    """``text`` cut just after the last place ``final``'s content appears in it. Templates often
    strip a message's surrounding whitespace: the content's own trailing whitespace is kept only
    where the template kept it."""
    content = final.get("content")
    if isinstance(content, list):  # content parts: the last text one is what must end the text
        texts = [part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError("continue_final_message needs a last message with text to continue.")
    core = content.strip()
    at = text.rfind(core)
    if at < 0:
        raise InvalidRequestError("continue_final_message: the chat template does not show the last message's "
                                  "text as it was sent, so it cannot be left open.")
    end = at + len(core)
    tail = content[len(content.rstrip()):]
    if tail and text.startswith(tail, end):
        end += len(tail)
    return text[:end]


def read_chat_template(value: str) -> str:
    """``--chat-template``: the file ``value`` names, or ``value`` itself as a template (vLLM
    takes both). A ValueError says why it is neither."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
    elif "{" not in value:  # no Jinja in it: a file name that is not there
        raise ValueError(f"no file {value}, and not a template either (no {{% or {{{{ in it)")
    try:
        _compile(value)
    except jinja2.TemplateError as e:
        raise ValueError(f"not a valid Jinja template: {e}") from None
    return value
