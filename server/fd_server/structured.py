"""A request's structured-output fields, in each spelling clients send, to one
``StructuredOutputsParams``: OpenAI's ``response_format`` (``json_object``, ``json_schema``
with ``strict``), vLLM's ``structured_outputs`` and its older ``guided_*`` fields. A request
may use one of them; an error names the field as the client wrote it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fd_core.engine.structured import StructuredOutputsParams
from fd_core.errors import InvalidRequestError
from fd_server.errors import bad_request
from fd_server.protocol import SamplingFields

@dataclass(frozen=True)
class Constraint:
    """A request's structured output and the field it came from, which errors name (the
    backend refusing it, say)."""

    params: StructuredOutputsParams
    field: str

    def after(self, text: str) -> Constraint:
        """The same grammar, holding once the output has written ``text``."""
        return Constraint(replace(self.params, starts_after=text), self.field)


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(request: SamplingFields) -> Constraint | None:
    """What ``request`` constrains its output to; None: free text."""
    sources: list[tuple[str, dict[str, Any], dict[str, str]]] = []  # (field, kwargs, where each kwarg came from)
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            sources.append(("response_format", {"json_object": True}, {"json_object": "response_format"}))
        elif fmt.type == "json_schema":
            spec = fmt.json_schema
            if spec is None or spec.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema.",
                                  param="response_format.json_schema")
            sources.append(("response_format", {"json": spec.schema_, "disable_additional_properties": bool(spec.strict)},
                            {"json": "response_format.json_schema.schema"}))
        else:
            raise bad_request(f"response_format type {fmt.type!r} is not supported; use text, json_object or "
                              f"json_schema.", param="response_format.type")
    so = request.structured_outputs
    if so is not None:
        given = so.model_dump(exclude_none=True, by_alias=True)
        sources.append(("structured_outputs", given, {k: f"structured_outputs.{k}" for k in given}))
    guided = {kind: getattr(request, name) for name, kind in _GUIDED.items() if getattr(request, name) is not None}
    if guided:
        kwargs: dict[str, Any] = dict(guided)
        if request.guided_whitespace_pattern is not None:
            raise bad_request("guided_whitespace_pattern is not supported; structured_outputs."
                              "disable_any_whitespace gives JSON without optional whitespace.",
                              param="guided_whitespace_pattern")
        where = {kind: name for name, kind in _GUIDED.items() if kind in guided}
        sources.append((", ".join(where.values()), kwargs, where))
    if not sources:
        return None
    if len(sources) > 1:
        names = " and ".join(s[0] for s in sources)
        raise bad_request(f"{names} each constrain the output; give one.", param=sources[1][0].split(",")[0])
    field, kwargs, where = sources[0]
    try:
        return Constraint(StructuredOutputsParams(**kwargs), field.split(",")[0])
    except InvalidRequestError as exc:
        kind = (exc.param or "").removeprefix("structured_outputs.")
        param = where.get(kind, field.split(",")[0])
        message = str(exc).replace(f"structured_outputs.{kind}", param) if kind else str(exc)
        raise bad_request(message, param=param) from exc
