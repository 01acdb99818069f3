"""Platform: one accelerator family as seen by the core."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from fd_core.interfaces.capabilities import Capabilities
from fd_core.interfaces.communicator import Communicator
from fd_core.interfaces.memory import Memory
from fd_core.interfaces.model_runner import ModelRunnerHooks


@runtime_checkable
class Platform(Protocol):
    """What a backend tells the core about its chip.

    ``name`` is what users type after ``--device``; ``device_type`` keys op registration (two
    platforms may share one device type, e.g. a vendor fork of cuda); ``runtime`` names the
    tensor library (``"paddle"``, ``"torch"``) this platform object runs on: its Memory and
    Communicator are that library's, and its reference ops back any op the backend does not
    implement itself.
    """

    name: str
    device_type: str
    runtime: str
    # Optional (API 1.1): the step token budget this chip wants when the user gives none,
    # e.g. a slow device picks a small one so a long prefill does not stall streams for long.
    # default_max_num_batched_tokens: int
    #
    # Optional (API 1.4): the most prompt tokens one request computes in a step while others
    # run or wait (budget they leave goes back to it), when the user gives none
    # (--long-prefill-token-threshold); a slow device picks one so a request behind a long
    # prompt starts within a step or two. None or 0: no cap.
    # default_long_prefill_token_threshold: int | None
    #
    # Optional (API 1.9): the dtype ``--dtype auto`` (the default) runs in. Absent, auto is the
    # narrowest of bfloat16, float16, float32 that ``capabilities()`` declares for both
    # ``dtypes`` and ``kv_cache_dtypes`` (fd_core.engine.config.auto_dtype).
    # default_dtype: str
    #
    # Optional (API 1.2): a platform that can run on more than one runtime lists them,
    # ``runtimes = ("paddle", "torch")``, its default (``runtime``) first; absent means
    # ``(runtime,)``. It then also implements ``with_runtime(name) -> Platform``: a copy bound
    # to ``name`` (``runtime == name``), whose ``memory``, ``communicator`` and
    # ``capabilities`` are those of that runtime. The engine calls it once at start-up when
    # the user asks for another runtime (``--runtime``), and every tensor-parallel rank does
    # the same. Op implementations tied to one runtime say so when registered
    # (``registry.register(..., runtime="paddle")``).
    # runtimes: tuple[str, ...]
    # def with_runtime(self, name: str) -> "Platform": ...

    def is_available(self) -> tuple[bool, str]:
        """Whether at least one device can be used now; if not, one sentence saying why."""
        ...

    def device_count(self) -> int: ...

    def capabilities(self) -> Capabilities: ...

    def memory(self, device_index: int = 0) -> Memory: ...

    def communicator(self, rank: int = 0, world_size: int = 1, rendezvous: str | None = None) -> Communicator:
        """The collectives of rank ``rank`` of ``world_size``. With ``world_size > 1`` the
        platform first joins its runtime's process group at ``rendezvous``,
        ``"host:port[,port...]"`` (one free port per rank; a runtime uses what it needs); every
        rank calls this at about the same time, each in its own process."""
        ...

    def runner_hooks(self) -> ModelRunnerHooks | None:
        """Optional per-chip additions to the shared model runner (e.g. graph capture)."""
        ...
