"""A chat request's ``tools`` and ``tool_choice``, checked, and how its output becomes a message.

``tool_choice``:
- ``none``: the model writes text (the tools still reach the chat template, as in vLLM).
- ``auto``: the model may call tools in its own format, which ``--tool-call-parser`` reads. It
  needs ``--enable-auto-tool-choice`` and a parser, as vLLM does.
- ``required``: structured output makes the model write a JSON array of one or more
  ``{"name", "parameters"}`` objects, each matching one tool's name and parameters schema.
- A named function: structured output makes it write that function's arguments.

In every mode a reply with calls has ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fd_core.engine.structured import StructuredOutputsParams
from fd_core.errors import InvalidRequestError
from fd_server.errors import bad_request
from fd_server.parsers import ReasoningParser, ToolParser, reasoning_parser, tool_parser
from fd_server.parsers.tools import Found, Scan, call_in_object, value_end
from fd_server.structured import Constraint

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # OpenAI's, with vLLM's dots and colons
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsers (``--tool-call-parser``, ``--reasoning-parser``) and whether
    ``tool_choice: auto`` is served (``--enable-auto-tool-choice``)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        # a name no parser has stops start-up (ValueError names the choices)
        if self.tool_parser is not None:
            tool_parser(self.tool_parser)
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")

    def reasoning(self) -> ReasoningParser | None:
        return None if self.reasoning_parser is None else reasoning_parser(self.reasoning_parser)


@dataclass
class ToolPlan:
    """What a request's tools mean for this reply."""

    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # for the chat template
    parser: ToolParser | None = None  # reads the output into calls (None: text)
    constraint: Constraint | None = None  # required and named

    @property
    def active(self) -> bool:
        return self.parser is not None


def _required_scan(text: str, final: bool) -> Scan:
    """``[{"name": ..., "parameters": {...}}, ...]``, as ``required`` constrains it."""
    start = text.find("[")
    calls: list[Found] = []
    at = text.find("{", start + 1) if start >= 0 else -1
    while at >= 0:
        end = value_end(text, at)
        call = call_in_object(text[at:] if end < 0 else text[at:end], ("parameters",))
        call.complete, call.whole = end >= 0, text[at:] if end < 0 else text[at:end]
        calls.append(call)
        if end < 0:
            break
        at = text.find("{", end)
    return Scan(0, calls)


def _named_scan(name: str):
    def scan(text: str, final: bool) -> Scan:
        body = text.lstrip()
        return Scan(0, [Found(name, body, final)] if body else [])
    return scan


def plan(request: Any, parsing: ChatParsing, constrained: bool) -> ToolPlan | None:
    """The request's tool plan (None: no tools). ``constrained``: the request also asks for
    structured output (refused beside required or named, which use it)."""
    tools, choice = request.tools, request.tool_choice
    if tools is None:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return None
    if not tools:
        raise bad_request("tools must list at least one tool.", param="tools")
    names: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        if tool.get("type", "function") != "function":
            raise bad_request(f"tools[{i}].type must be 'function', got {tool.get('type')!r}.", param=f"tools.{i}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"tools[{i}].function is required.", param=f"tools.{i}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name is required.", param=f"tools.{i}.function.name")
        if not _NAME.match(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ . : or -; got {name!r}.",
                              param=f"tools.{i}.function.name")
        if name in names:
            raise bad_request(f"tools[{i}].function.name {name!r} is given twice.", param=f"tools.{i}.function.name")
        parameters = function.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.",
                              param=f"tools.{i}.function.parameters")
        names[name] = parameters
    choice = "auto" if choice is None else choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type", "function") == "function" else None
        wanted = function.get("name") if isinstance(function, dict) else None
        if not isinstance(wanted, str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}.", param="tool_choice")
        if wanted not in names:
            raise bad_request(f"tool_choice names {wanted!r}, which is not among the tools ({', '.join(names)}).",
                              param="tool_choice")
        mode = "named"
    elif choice in ("none", "auto", "required"):
        mode = choice
    else:
        raise bad_request(f"tool_choice must be none, auto, required or a named function, got {choice!r}.",
                          param="tool_choice")
    if mode in ("named", "required") and constrained:
        raise bad_request(f"tool_choice {mode} constrains the output itself; it cannot be combined with "
                          f"response_format or structured outputs.", param="tool_choice")
    result = ToolPlan(mode, list(tools))
    if mode == "auto":
        if not parsing.enable_auto_tool_choice or parsing.tool_parser is None:
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser.', param="tool_choice")
        result.parser = tool_parser(parsing.tool_parser)
    elif mode == "named":
        result.parser = ToolParser("named", _named_scan(wanted))
        result.constraint = _constraint(json_schema=names[wanted], param=f"tools.{list(names).index(wanted)}"
                                                                           f".function.parameters")
    elif mode == "required":
        items = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": parameters},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, parameters in names.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        result.parser = ToolParser("required", _required_scan)
        result.constraint = _constraint(json_schema=schema, param="tools")
    return result


def _constraint(json_schema: dict[str, Any], param: str) -> Constraint:
    try:
        return Constraint(StructuredOutputsParams(json=json_schema), "tool_choice")
    except InvalidRequestError as exc:
        raise bad_request(str(exc).replace("structured_outputs.json", param), param=param) from exc
