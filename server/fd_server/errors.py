"""Every failure leaves the server as an OpenAI error object with the right status.

``{"error": {"message", "type", "param", "code"}}``, where the status is

- 400 ``invalid_request_error``: a malformed body, a wrong type or range (FastAPI's 422 is
  turned into 400, as OpenAI answers), a bad prompt or sampling parameter. A prompt that does
  not fit the context window is also a 400, with code ``context_length_exceeded``, because that
  is what OpenAI returns and what clients (LangChain, the ``openai`` package) match on;
- 401 a missing or wrong API key; 404 an unknown model or route; 405 a wrong method; 413 a body
  over 32 MiB (however it is sent); 429 too many requests in flight;
- 503 the engine is unavailable (its process died, or it has not reported within the heartbeat
  timeout); 504 a request that ran past the server's ``--request-timeout`` (it was aborted);
- 500 only for an unexpected exception, which is logged with its traceback.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fd_core import errors as fd_errors
from fd_core.errors import FdError, InvalidRequestError, PromptTooLongError

log = logging.getLogger("fd_server")

try:
    from fd_core.errors import EngineDeadError
except ImportError:  # fd_core adds it with the engine-core process; until then, our own
    class EngineDeadError(FdError, RuntimeError):  # type: ignore[no-redef]
        """The engine-core process is gone."""


class APIError(Exception):
    """An error with its HTTP status and OpenAI fields, raised anywhere in a handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def engine_unavailable(reason: str = "") -> APIError:
    message = "The engine is unavailable" + (f": {reason}" if reason else "") + "; retry on another replica."
    return APIError(503, message, type="service_unavailable_error", code="engine_unavailable",
                    headers={"Retry-After": "5"})


def request_timeout(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s (the server's --request-timeout); "
                         f"it was aborted.", type="timeout_error", code="request_timeout")


def internal_error() -> APIError:
    return APIError(500, "The server hit an unexpected error; it has been logged.", type="server_error",
                    code="internal_error")


def from_exception(exc: BaseException) -> APIError:
    """The API error for any exception a request may raise."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineDeadError, fd_errors.SchedulerUnavailableError)):
        return engine_unavailable(str(exc))
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc))
    if isinstance(exc, (fd_errors.CheckpointError, fd_errors.ConfigError)):
        # raised on a request's path by something the request chose (a chat template, say)
        return bad_request(str(exc))
    log.error("unexpected error while serving a request", exc_info=exc)
    return internal_error()


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal", "json-or-python"}


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in _TYPE_TAGS)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    # For a union (``stop: str | list[str]``) pydantic reports one error per member; the
    # deepest one says most (``stop.0: Input should be a valid string``).
    head = errors[0].get("loc", ())[:2]
    first = max((e for e in errors if e.get("loc", ())[:2] == head), key=lambda e: len(e.get("loc", ())))
    # pydantic puts the union member it tried ("str", "list[int]"...) in the location
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "The request body must be a JSON object, sent with 'Content-Type: application/json'.", None
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    param = ".".join(loc) or None
    message = first.get("msg", "invalid value")
    where = f"{param}: " if param else ""
    others = {tuple(e.get("loc", ()))[:2] for e in errors} - {tuple(head)}
    more = f" (and {len(others)} more field{'s' if len(others) > 1 else ''} with problems)" if others else ""
    return f"{where}{message}{more}", param


def install(app: FastAPI) -> None:
    """Register the handlers that give every error the OpenAI shape."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return bad_request(message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))
        return error.response()

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(FdError)
    async def _fd(_: Request, exc: FdError) -> JSONResponse:
        return from_exception(exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).response()
