"""ModelRunner: the one runner every backend shares, and the hooks a backend may add to it."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable


@runtime_checkable
class ModelRunner(Protocol):
    """Turns a scheduled batch into sampled tokens. fd has one implementation
    (``fd_core.engine.model_runner``); backends customise it through :class:`ModelRunnerHooks`
    instead of copying it."""

    def load_model(self) -> None: ...

    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    def execute(self, batch: Any) -> Any:
        """Run one forward over a scheduled batch and sample one token per sampling row."""
        ...


@runtime_checkable
class ModelRunnerHooks(Protocol):
    """Optional chip-specific steps around the shared runner. Every method may be absent."""

    def wrap_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """Return a replacement for the model forward (e.g. one that replays captured graphs)."""
        ...
