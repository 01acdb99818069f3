"""One log line per engine request received and one as it ends, as vLLM's request logger
writes them (``--disable-log-requests`` turns both off; so does ``--log-level warning``).

A line names the request, its size and its parameters; of the prompt it shows a short prefix
only, so that a log does not keep what users wrote.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fd_core.engine.wire import params_to_wire
from fd_core.engine.sampling_params import SamplingParams

log = logging.getLogger("fd_server.requests")

PROMPT_PREFIX_CHARS = 32
_VALUE_CHARS = 40  # of one parameter's value (a stop string may be long)


def _short(value: Any, limit: int) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def received(request_id: str, prompt_token_ids: list[int], prompt_text: str | None,
             params: SamplingParams) -> None:
    """``received request ID: N prompt tokens 'prefix...', params a=1, b=2``."""
    if not log.isEnabledFor(logging.INFO):
        return
    prefix = ""
    if prompt_text is not None:
        more = "..." if len(prompt_text) > PROMPT_PREFIX_CHARS else ""
        prefix = f" {prompt_text[:PROMPT_PREFIX_CHARS]!r}{more}"
    fields = ", ".join(f"{k}={_short(v, _VALUE_CHARS)}" for k, v in params_to_wire(params).items())
    log.info("received request %s: %d prompt tokens%s, params %s", request_id, len(prompt_token_ids), prefix,
             fields or "default")


def ended(request_id: str, arrival: float, output: Any, error: BaseException | None) -> None:
    """``finished request ID: N tokens (reasons) in S s``, or how it ended otherwise: failed
    (with the error) or aborted (the client went away, or it was cancelled)."""
    if not log.isEnabledFor(logging.INFO):
        return
    elapsed = time.monotonic() - arrival
    if output is not None and output.finished:
        tokens = sum(len(o.token_ids) for o in output.outputs)
        reasons = ", ".join(sorted({str(o.finish_reason) for o in output.outputs}))
        log.info("finished request %s: %d tokens (%s) in %.2f s", request_id, tokens, reasons, elapsed)
    elif error is not None:
        log.info("failed request %s after %.2f s: %s", request_id, elapsed, error)
    else:
        log.info("aborted request %s after %.2f s", request_id, elapsed)
