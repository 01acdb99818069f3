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
    """A request or its sampling parameters are invalid."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit in ``max_model_len``."""


class ConfigError(FdError, ValueError):
    """The engine configuration is invalid or asks for something the backend cannot do."""


class BackendError(FdError, RuntimeError):
    """No usable backend for the requested device, or a backend failed at start-up."""


class EngineDeadError(FdError, RuntimeError):
    """The engine-core process has died or failed; no request can run until the server restarts."""
