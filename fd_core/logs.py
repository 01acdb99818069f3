"""Logging of every process fd starts: one format, one level, the process's role in each line.

The CLI (``--log-level``), the engine-core process of ``fd serve`` and every tensor-parallel rank
call ``configure``; a child is handed its parent's level (``effective_level``) through its
arguments, so ``--log-level`` reaches every process. The default is ``$FD_LOG_LEVEL``, else
``info``. A line reads::

    2026-11-24 14:30:36,244 INFO [engine] fd.startup: loading weights: done in 6.12 s (272 tensors, 513.1 MiB on the device)

fd's loggers (``fd``, ``fd_server``, and uvicorn's, which ``fd serve`` runs) log at the chosen
level; other libraries' loggers at warning and above. The handler sits on the root logger, so
a library that adds its own root handler only when there is none (Paddle does, at INFO) adds
nothing.
"""

from __future__ import annotations

import logging
import os
import sys

from fd_core.errors import ConfigError

LEVELS = ("debug", "info", "warning", "error")
ENV = "FD_LOG_LEVEL"
OWN_LOGGERS = ("fd", "fd_server", "uvicorn")
_FORMAT = "%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s"


class _Handler(logging.StreamHandler):
    """fd's handler, told apart from others' so that configuring again replaces it."""


def parse_level(value: str | int | None, source: str = "--log-level") -> int:
    """A level from its name (debug, info, warning, error; any case) or number; None means
    ``$FD_LOG_LEVEL``, else info. Anything else is a ConfigError naming ``source``."""
    if value is None:
        value, source = os.environ.get(ENV) or "info", ENV
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    if text.lower() not in LEVELS:
        raise ConfigError(f"{source} {value!r}: accepted values are {', '.join(LEVELS)}")
    return logging.getLevelName(text.upper())


def configure(level: str | int | None = None, role: str = "main") -> int:
    """Set up logging for this process (an fd process: the CLI, the engine core, a rank) and
    return the level. Calling it again replaces fd's handler."""
    level = parse_level(level)
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=role)))
    root = logging.getLogger()
    for old in [h for h in root.handlers if _replaced(h)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))  # other libraries: warnings and errors
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(level)
    return level


# At import, where the root logger has no handler, Paddle adds a plain one on stderr with this
# format (and sets the root level to INFO): beside fd's it would print every line twice.
_PADDLE_FORMAT = "[%(asctime)-15s] [%(levelname)8s] %(filename)s:%(lineno)s - %(message)s"


def _plain_stderr(handler: logging.Handler) -> bool:
    return type(handler) is logging.StreamHandler and handler.stream in (sys.stderr, sys.__stderr__)


def _paddles(handler: logging.Handler) -> bool:
    return _plain_stderr(handler) and getattr(handler.formatter, "_fmt", None) == _PADDLE_FORMAT


def _replaced(handler: logging.Handler) -> bool:
    """In a process fd owns: its own handler, and any plain one on stderr (Paddle's)."""
    return isinstance(handler, _Handler) or _plain_stderr(handler)


def configure_default(role: str = "main") -> None:
    """``configure`` unless the application has set up logging itself (a handler on the root
    logger other than Paddle's), as ``logging.basicConfig`` does: for ``LLM(...)`` in someone
    else's script."""
    if all(_paddles(h) for h in logging.getLogger().handlers):
        configure(None, role)


def effective_level() -> int:
    """The level fd's loggers log at in this process: what a child process is handed."""
    return logging.getLogger("fd").getEffectiveLevel()


def rank_level(level: int, rank: int) -> int:
    """The level of a tensor-parallel rank: rank 0 speaks for all; the others log warnings
    and errors only, unless debugging."""
    return level if rank == 0 or level <= logging.DEBUG else max(level, logging.WARNING)
