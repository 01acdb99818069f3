"""Typed errors a user can catch. Each says in one sentence what is wrong and with which input."""

from __future__ import annotations


class FdError(Exception):
    """Base of every error fd raises on purpose."""


class ModelNotFoundError(FdError, FileNotFoundError):
    """The model name or path does not resolve to a local checkpoint."""


class UnsupportedArchitectureError(FdError, ValueError):
    """The checkpoint's architecture has no fd model definition."""


class CheckpointError(FdError, ValueError):
    """A checkpoint exists but is malformed (missing tensor, wrong shape, unreadable file)."""


class InvalidRequestError(FdError, ValueError):
    """A request or its sampling parameters are invalid; ``param``, where known, names the field."""

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit in ``max_model_len``."""


class ConfigError(FdError, ValueError):
    """The engine configuration is invalid or asks for something the backend cannot do."""


class BackendError(FdError, RuntimeError):
    """No usable backend for the requested device, or a backend failed at start-up."""


class EngineDeadError(FdError, RuntimeError):
    """The engine-core process has died or failed; no request can run until the server restarts."""


class SchedulerUnavailableError(FdError, ConnectionError):
    """The global scheduler (its Redis, or every instance of a role) cannot take the request, or
    the instance running it stopped; the message names which."""


def lone_surrogate(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (JSON's ``"\\ud800"`` decodes to one), which can be
    neither tokenized nor encoded as UTF-8, as "U+D800 at character 3"; None if nowhere."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"U+{ord(text[exc.start]):04X} at character {exc.start}"
    return None


def check_text(field: str, text: str) -> None:
    """Raise InvalidRequestError naming ``field`` unless ``text`` is valid Unicode: it must be
    refused where text enters, not fail deep inside."""
    where = lone_surrogate(text)
    if where:
        raise InvalidRequestError(f"{field} is not valid Unicode text: it holds a lone surrogate ({where})")


def rebuild(error_type: str, message: str, fallback: type[FdError]) -> FdError:
    """An error another process reported by its type's name: the same fd error type, else
    ``fallback`` naming the original type."""
    cls = globals().get(error_type)
    if isinstance(cls, type) and issubclass(cls, FdError):
        return cls(message)
    return fallback(f"{error_type}: {message}")
