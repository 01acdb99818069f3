"""What an instance's role adds to the engine core's side of the global scheduler. A mixed
instance (this class) adds nothing: it pulls requests from the queues and runs them whole. A
prefill or a decode instance (``fd_core.cluster.disaggregation``) overrides the hooks.
``inbox`` is the ``ClusterInbox`` calling: its ``origins`` (request id -> where results go),
``failures`` (by origin) and ``finished`` (requests to forget in Redis)."""

from __future__ import annotations

from typing import Any

from fd_core.cluster.global_scheduler import Load


class Role:
    hand_over = False  # requests stop after their first token (EngineCore.add_request(hand_over=True))
    takes_queue = True  # requests come from the scheduler's queues (a decode instance's come from prefill instances)
    stats: Any = None  # TransferStats where the role moves KV caches

    def abort(self, core: Any, request_id: str, index: int | None) -> None:
        core.abort(request_id, index)

    def room(self, core: Any, room: int) -> int:
        """How many requests to pull now, of the ``room`` the engine has."""
        return room

    def pulled(self, request_id: str, payload: bytes) -> None:
        """A request taken from a queue into the engine, as its submitter queued it."""

    def poll(self, core: Any, inbox: Any) -> int:
        """Work of the role's own at each poll, before the queues are read; how many requests it took."""
        return 0

    def stepped(self, core: Any, inbox: Any) -> None:
        """After an engine step's outputs are queued for their submitters."""

    def forget(self, request_id: str) -> None:
        """A request that left the engine."""

    def report(self, load: Load) -> None:
        """Add the role's part to the load report."""

    def close(self) -> None:
        """A clean stop."""
