"""Reasoning parsers: a thinking model's output split into ``reasoning_content`` and ``content``.

Each format is one function, ``split(text, final, thinking)``: the reasoning and the content of
``text``. When ``final`` is false the text may still grow, so a split leaves out whatever the
next tokens could change (a partial ``</think>``, a newline that may turn out to precede a
closing tag). Its results therefore only ever grow, and a stream sends what was added
(``ReasoningStream``). Streamed deltas join to exactly what the whole text gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fd_core.engine.detokenizer import stop_holdback

THINK, END_THINK = "<think>", "</think>"
RESPONSE, END_RESPONSE = "<response>", "</response>"
TOOL_CALL = "<tool_call>"

Split = Callable[[str, bool, bool], tuple[str, str]]


def held_back(text: str, *tags: str) -> int:
    """How many trailing characters of ``text`` could be the start of one of ``tags`` (the
    detokenizer's hold-back for stop strings)."""
    return stop_holdback(text, tags)


def _think(text: str, final: bool, thinking: bool, starts_inside: bool) -> tuple[str, str]:
    """``<think>`` (optional: the prompt may have opened it) ... ``</think>`` then the answer.
    No ``</think>``: all reasoning while thinking (a cut-off thought stays reasoning), all
    content when the request turned thinking off."""
    body = text
    stripped = body.lstrip()
    if stripped.startswith(THINK):
        body = stripped[len(THINK):]
    elif not final and THINK.startswith(stripped):
        return "", ""  # may still become <think>
    end = body.find(END_THINK)
    if end < 0:
        if not thinking and not starts_inside:
            return "", body
        keep = len(body) if final else len(body) - held_back(body, END_THINK)
        return body[:keep], ""
    return body[:end], body[end + len(END_THINK):]


def qwen3(text: str, final: bool, thinking: bool = True) -> tuple[str, str]:
    return _think(text, final, thinking, starts_inside=False)


def deepseek_r1(text: str, final: bool, thinking: bool = True) -> tuple[str, str]:
    """R1's template opens ``<think>`` in the prompt: the output starts inside the thought."""
    return _think(text, final, thinking, starts_inside=True)


def ernie_x1(text: str, final: bool, thinking: bool = True) -> tuple[str, str]:
    """ERNIE-4.5-21B-A3B-Thinking: the prompt opens the thought; after ``</think>`` comes the
    answer in ``<response>``...``</response>`` (one newline inside each tag is layout), or tool
    calls, or a bare answer (kept as content)."""
    reasoning, rest = _think(text, final, thinking, starts_inside=True)
    if END_THINK not in text:
        return reasoning, rest
    body = rest.lstrip("\n")
    if not body.startswith(RESPONSE):
        if not final and RESPONSE.startswith(body):
            return reasoning, ""  # may still become <response>
        return reasoning, body
    answer = body[len(RESPONSE):]
    if answer.startswith("\n"):
        answer = answer[1:]
    elif not final and not answer:
        return reasoning, ""
    end = answer.find(END_RESPONSE)
    if end >= 0:
        answer = answer[:end]
        return reasoning, answer.removesuffix("\n")
    if not final:  # a newline, or part of </response>, may be the end's
        answer = answer[: len(answer) - held_back(answer, "\n" + END_RESPONSE, END_RESPONSE)]
    return reasoning, answer


@dataclass
class ReasoningParser:
    name: str
    split: Split
    end: str = END_THINK  # what ends the thought: structured output of the answer starts after it

    def parse(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a whole output; None where empty."""
        reasoning, content = self.split(text, True, thinking)
        return reasoning or None, content or None

    def stream(self, thinking: bool = True) -> ReasoningStream:
        return ReasoningStream(self.split, thinking)


class ReasoningStream:
    """Splits an output as it arrives: ``feed(delta)`` gives the reasoning and the content it
    adds; ``finish()`` what was held back."""

    def __init__(self, split: Split, thinking: bool) -> None:
        self._split, self._thinking = split, thinking
        self.text = ""
        self._sent = ("", "")

    def _diff(self, final: bool) -> tuple[str, str]:
        reasoning, content = self._split(self.text, final, self._thinking)
        sent_r, sent_c = self._sent
        # what was sent is always a prefix of what the longer text gives (see the module doc)
        self._sent = (max(sent_r, reasoning, key=len), max(sent_c, content, key=len))
        return reasoning[len(sent_r):], content[len(sent_c):]

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._diff(False)

    def finish(self) -> tuple[str, str]:
        return self._diff(True)

    @property
    def ended(self) -> bool:
        """Whether the reasoning is over (the rest is answer)."""
        return END_THINK in self.text


REASONING_PARSERS: dict[str, Split] = {"qwen3": qwen3, "deepseek_r1": deepseek_r1, "ernie_x1": ernie_x1}
