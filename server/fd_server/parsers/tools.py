"""Tool-call parsers: the calls a model wrote in its own format, as OpenAI ``tool_calls``.

A format is one function, ``scan(text, final)``. It returns where the content before the first
call ends, and the calls found so far. For each call it gives the name once complete, and the
arguments as the model wrote them (JSON text). With ``final`` false it leaves out what the next
tokens could change: a partial opening tag, or the start of a closing one. So every name and
argument string only grows, and ``ToolStream`` sends what was added, in OpenAI's shape: a call's
id and name first, then argument fragments. The fragments join to exactly the arguments the whole
text gives.

A whole output whose calls do not parse (malformed JSON, a missing name, a call cut off) comes
back as content with no calls; it is never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fd_server.parsers.reasoning import held_back


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class Found:
    """One call as far as the text goes."""

    name: str | None  # None until the whole name is there
    arguments: str  # the model's JSON text so far
    complete: bool  # its end was seen
    whole: str | None = None  # a call written as one JSON object: that object's text


@dataclass
class Scan:
    content_end: int  # the content is text[:content_end]
    calls: list[Found]


Format = Callable[[str, bool], Scan]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# -- JSON pieces ---------------------------------------------------------------------------

_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


_STRUCTURE = re.compile(r'["{}\[\]]')


def value_end(text: str, start: int) -> int:
    """The index just past the JSON object or array starting at ``text[start]``; -1 if it is
    not closed yet. A stream scans its text again at every delta, so the scan jumps from one
    bracket or quote to the next (a regular expression; ``str.find`` within strings) rather
    than walking every character in Python: a 16,000-character call streamed 4 characters at a
    time took 1.3 ms a delta walking (``llama3_json``), 0.1 ms jumping."""
    depth, at = 0, start
    while (found := _STRUCTURE.search(text, at)) is not None:
        at = found.end()
        c = found.group()
        if c == '"':  # skip the string: to its closing quote, past escaped characters
            while True:
                quote = text.find('"', at)
                if quote < 0:
                    return -1
                escape = text.find("\\", at, quote)
                if escape < 0:
                    at = quote + 1
                    break
                at = escape + 2
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return at
    return -1


def call_in_object(body: str, keys: tuple[str, ...]) -> Found:
    """A call written as ``{"name": ..., "<key>": {...}}`` (``body`` may be cut short): the
    name once its string is closed, the arguments object's text as far as it goes."""
    match = _NAME.search(body)
    name = json.loads(match.group(1)) if match else None
    arguments = ""
    for key in keys:
        found = re.search(rf'"{key}"\s*:\s*', body)
        if found:
            start = found.end()
            if start < len(body) and body[start] in "{[":
                end = value_end(body, start)
                arguments = body[start:] if end < 0 else body[start:end]
            break
    return Found(name, arguments, False)


def _valid(call: Found) -> bool:
    if not call.name:
        return False
    try:
        json.loads(call.arguments)
        if call.whole is not None and not isinstance(json.loads(call.whole), dict):
            return False
    except ValueError:
        return False
    return True


# -- the formats ---------------------------------------------------------------------------

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def hermes(text: str, final: bool) -> Scan:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, any
    whitespace around the JSON (Qwen 2.5 and 3, Hermes, ERNIE-4.5 Thinking's calls)."""
    first = text.find(OPEN)
    if first < 0:
        return Scan(len(text) if final else len(text) - held_back(text, OPEN), [])
    calls, at = [], first
    while at >= 0:
        start = at + len(OPEN)
        end = text.find(CLOSE, start)
        body = text[start:] if end < 0 else text[start:end]
        call = call_in_object(body, ("arguments", "parameters"))
        if not call.arguments and end >= 0:
            call.arguments = "{}"  # a call without arguments
        call.complete, call.whole = end >= 0, body
        calls.append(call)
        at = -1 if end < 0 else text.find(OPEN, end + len(CLOSE))
    return Scan(first, calls)


PYTHON_TAG = "<|python_tag|>"


def llama3_json(text: str, final: bool) -> Scan:
    """Llama 3.1/3.2: the reply is a call, ``{"name": ..., "parameters": {...}}`` (optionally
    after ``<|python_tag|>``), several joined by ``;``. A reply that starts otherwise is content."""
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG):].lstrip()
    elif not head.startswith("{"):
        maybe = not final and (PYTHON_TAG.startswith(head) or not head)
        return Scan(0 if maybe else len(text), [])
    calls, at = [], 0
    while at < len(head) and head[at] == "{":
        end = value_end(head, at)
        call = call_in_object(head[at:] if end < 0 else head[at:end], ("parameters", "arguments"))
        call.complete, call.whole = end >= 0, head[at:] if end < 0 else head[at:end]
        if call.complete and not call.arguments:
            call.arguments = "{}"
        calls.append(call)
        if end < 0:
            break
        rest = head[end:]
        at = end + len(rest) - len(rest.lstrip().lstrip(";").lstrip())
    return Scan(0, calls)


CALLS = "<｜tool▁calls▁begin｜>"  # U+FF5C and U+2581, as DeepSeek's vocabulary spells them
CALLS_END = "<｜tool▁calls▁end｜>"
CALL = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
FENCE = "```"


def deepseek_v3(text: str, final: bool) -> Scan:
    """DeepSeek V3 / R1-0528: ``<｜tool▁calls▁begin｜>`` then per call
    ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``."""
    first = text.find(CALLS)
    if first < 0:
        return Scan(len(text) if final else len(text) - held_back(text, CALLS), [])
    calls, at = [], text.find(CALL, first)
    while at >= 0:
        sep = text.find(SEP, at)
        if sep < 0:
            calls.append(Found(None, "", False))
            break
        head_end = text.find("\n", sep)
        name = text[sep + len(SEP):head_end].strip() if head_end >= 0 else None
        call = Found(name or None, "", False)
        calls.append(call)
        if head_end < 0:
            break
        fence = text.find(FENCE + "json\n", head_end)
        if fence < 0:
            break
        start = fence + len(FENCE + "json\n")
        end = text.find(CALL_END, start)
        if end >= 0:
            body = text[start:end]
            if body.rstrip().endswith(FENCE):  # the closing fence and the newline before it are layout
                body = body.rstrip()[: -len(FENCE)]
                body = body.removesuffix("\n")
            call.arguments = body
            call.complete = True
            at = text.find(CALL, end)
        else:
            body = text[start:]
            call.arguments = body if final else body[: len(body) - held_back(body, "\n" + FENCE + CALL_END)]
            break
    return Scan(first, calls)


TOOL_FORMATS: dict[str, Format] = {"hermes": hermes, "qwen3": hermes, "ernie_x1": hermes,
                                   "llama3_json": llama3_json, "deepseek_v3": deepseek_v3}


# -- parsing ---------------------------------------------------------------------------------


@dataclass
class ToolParser:
    name: str
    scan: Format

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a whole output. Content is the text before the first call
        (None if blank); an output whose calls do not all parse is content, with no calls."""
        found = self.scan(text, True)
        if not found.calls:
            return text or None, []
        if not all(_valid(c) for c in found.calls):
            return text or None, []
        content = text[: found.content_end]
        return (content if content.strip() else None), [ToolCall(c.name, c.arguments) for c in found.calls]

    def stream(self) -> ToolStream:
        return ToolStream(self.scan)


@dataclass
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, in the first delta of a call
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        function: dict = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


class ToolStream:
    """Parses an output as it arrives. ``feed(delta)`` returns the content it adds and the call
    deltas; ``finish()`` returns the rest. A call's id and name go out once its name is
    complete, then its arguments as they grow."""

    def __init__(self, scan: Format) -> None:
        self._scan = scan
        self.text = ""
        self._content = 0  # characters of content sent
        self.calls: list[ToolCall] = []  # started ones; arguments hold what was sent

    def _step(self, final: bool) -> tuple[str, list[CallDelta]]:
        found = self._scan(self.text, final)
        content = ""
        if not self.calls:  # content stops at the first call
            end = found.content_end
            if final and found.calls and not all(_valid(c) for c in found.calls):
                end = len(self.text)  # as parse(): nothing parses, all of it is content
            content = self.text[self._content:end]
            self._content = max(self._content, end)
            if final and not all(_valid(c) for c in found.calls):
                return content, []
        deltas = []
        for index, call in enumerate(found.calls):
            if index == len(self.calls):
                if call.name is None:
                    break
                self.calls.append(ToolCall(call.name, ""))
                deltas.append(CallDelta(index, "", self.calls[index].id, call.name))
            sent = self.calls[index]
            more = call.arguments[len(sent.arguments):] if call.arguments.startswith(sent.arguments) else ""
            if more:
                sent.arguments += more
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments += more
                else:
                    deltas.append(CallDelta(index, more))
        return content, deltas

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        self.text += delta
        return self._step(False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._step(True)
