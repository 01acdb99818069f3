"""What a request asks structured output for, checked and translated to an llguidance grammar
when it is made (so a bad schema, regex or grammar is a 400 at the door, not a failure in a
step)."""

from __future__ import annotations

import copy
import json as jsonlib
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from fd_core.errors import InvalidRequestError, check_text

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar; each distinct one is compiled once per engine
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """vLLM's fields: exactly one of ``json`` (a JSON schema, as a dict or its text),
    ``regex``, ``choice`` (the output is one of these strings), ``grammar`` (Lark, or GBNF as
    llama.cpp writes it) and ``json_object`` (any JSON object). ``disable_any_whitespace``:
    JSON without optional whitespace (a small model given free whitespace may spend its tokens
    on it). ``disable_additional_properties``: objects whose schema does not say otherwise take
    no properties beyond those listed (OpenAI's ``strict``). ``starts_after``: the grammar holds
    only once the output has written this text's tokens (a reasoning model's end-of-thought tag:
    the thought is free, the answer constrained); None: from the first token."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    starts_after: str | None = None
    # the llguidance grammar the engine compiles (computed, not sent)
    spec: str = field(init=False, repr=False, compare=False, default="")

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            what = f"got {', '.join(given)}" if given else "got none"
            raise InvalidRequestError(f"structured output takes exactly one of {', '.join(KINDS)}; {what}",
                                      param="structured_outputs")
        kind = given[0]
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a boolean", param=f"structured_outputs.{name}")
        if self.starts_after is not None and (not isinstance(self.starts_after, str) or not self.starts_after):
            raise InvalidRequestError("starts_after must be a non-empty string", param="structured_outputs.starts_after")
        self.spec = _grammar(kind, _canonical(kind, getattr(self, kind)), self.disable_any_whitespace,
                             self.disable_additional_properties)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        """Its wire form: the fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.init and getattr(self, f.name) not in (None, False)}

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> StructuredOutputsParams:
        """From its wire form (the core process rebuilds, and so re-checks, what it runs)."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}",
                                      param="structured_outputs")
        return cls(**value)


def _canonical(kind: str, value: Any) -> str:
    """``value`` checked, as text: the cache key of its grammar."""
    param = f"structured_outputs.{kind}"

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"{param} {why}", param=param)

    if kind == "json_object":
        if value is not True:
            raise bad("must be true")
        return ""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = jsonlib.loads(value)
            except ValueError as exc:
                raise bad(f"is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise bad(f"must be a JSON schema (an object), got {type(value).__name__}")
        try:
            text = jsonlib.dumps(value, allow_nan=False)  # key order kept: properties are generated in it
        except (TypeError, ValueError) as exc:
            raise bad(f"is not JSON: {exc}") from None
    elif kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad("must be a non-empty list of non-empty strings")
        if len(value) > MAX_CHOICES:
            raise bad(f"takes at most {MAX_CHOICES} strings, got {len(value)}")
        for c in value:
            check_text(param, c)
        text = jsonlib.dumps(list(value))
    else:
        if not isinstance(value, str) or not value:
            raise bad("must be a non-empty string")
        check_text(param, value)
        text = value
    if len(text) > MAX_SPEC_CHARS:
        raise bad(f"may have at most {MAX_SPEC_CHARS} characters, got {len(text)}")
    return text


_ASCII = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """``regex`` with ``\\d`` and ``\\w`` meaning ASCII digits and word characters, as in
    xgrammar and outlines (and so in vLLM): llguidance's Rust regex reads them as Unicode
    classes, which lets a model spell a "digit" with any of some 700 code points."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            if nxt in _ASCII:
                out.append(_ASCII[nxt] if in_class else f"[{_ASCII[nxt]}]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if regex[i + 1 : i + 2] == "^":
                out.append("^")
                i += 1
            if regex[i + 1 : i + 2] == "]":  # a leading ] is literal
                out.append("]")
                i += 1
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    properties and does not say."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@lru_cache(maxsize=512)
def _grammar(kind: str, text: str, compact: bool, closed: bool) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    param = f"structured_outputs.{kind}"
    options = {"whitespace_flexible": False} if compact else None
    if kind in ("json", "json_object"):
        schema = jsonlib.loads(text) if kind == "json" else {"type": "object"}
        if closed:
            schema = _closed(copy.deepcopy(schema))
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (ValueError, TypeError) as exc:  # e.g. an integer past 64 bits, which llguidance cannot hold
            raise InvalidRequestError(f"{param} is not a valid JSON schema: {exc}", param=param) from None
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(ascii_classes(text))
    elif kind == "choice":
        # Lark string literals take JSON's escapes
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(jsonlib.dumps(c) for c in jsonlib.loads(text)))
    else:
        try:
            lark = any_to_lark(text)  # GBNF (``::=``) is translated, Lark kept
        except Exception as exc:  # noqa: BLE001 - the translator's own parse errors
            raise InvalidRequestError(f"{param} is not a valid grammar: {exc}", param=param) from None
        grammar = LLMatcher.grammar_from_lark(lark)
    error = LLMatcher.validate_grammar(grammar)
    if error:
        what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
                "choice": "choice", "grammar": "grammar"}[kind]
        raise InvalidRequestError(f"{param} is not a valid {what}: {error.strip()}", param=param)
    return grammar
