"""What bounds the work and the waiting one client can cause: the server's limits and timeouts.

Each is a flag of ``fd serve`` (``--max-concurrency``, ``--max-sequences-per-request``,
``--request-timeout``, ``--heartbeat-timeout``, ``--tokenizer-pool-size``). The per-field bounds
of a request body (``n``, ``top_k``, ``seed``, token ids, stop strings...) are not here: they
belong to ``fd_core.engine.sampling_params``, so the offline API has the same ones.
docs/ARCHITECTURE.md ("Limits, timeouts and health") says how they fit together.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 32 << 20  # far above any prompt that fits a context window
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256  # prompts × n: n=128 (the most a request may ask) for two prompts
DEFAULT_REQUEST_TIMEOUT_S = 600.0  # 8k tokens at the CPU's ~20 tokens/s fit; a frozen engine does not hold a client forever
DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0  # an idle core reports every 0.25 s, a busy one every step (< 5 s on the CPU)
DEFAULT_TOKENIZER_POOL_SIZE = 4


@dataclass(frozen=True)
class ServerLimits:
    """``None`` (or 0 for the timeouts) switches a limit off."""

    max_concurrency: int | None = None  # generation requests in flight before 429
    max_sequences_per_request: int | None = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT_S
    # /health is 503 (and new requests too) when the engine core has not reported for this long
    heartbeat_timeout: float | None = DEFAULT_HEARTBEAT_TIMEOUT_S
    tokenizer_pool_size: int = DEFAULT_TOKENIZER_POOL_SIZE  # threads for tokenization and chat templates
    max_body_bytes: int = MAX_BODY_BYTES

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "max_sequences_per_request"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("request_timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        if isinstance(self.tokenizer_pool_size, bool) or not isinstance(self.tokenizer_pool_size, int) \
                or self.tokenizer_pool_size < 1:
            raise ValueError(f"tokenizer_pool_size must be a positive integer, got {self.tokenizer_pool_size!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
