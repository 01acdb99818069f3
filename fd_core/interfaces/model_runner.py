"""ModelRunner: the one runner every backend shares, and the hooks a backend may add to it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable


@dataclass(frozen=True)
class RunnerLimits:
    """The engine's bounds on a step, fixed at start-up: what a hook needs to size anything it
    prepares ahead of time (e.g. one captured graph per decode batch size up to max_num_seqs)."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    # speculative decoding (API 1.13): the most drafts a sequence verifies in a step (0: none),
    # so a step's decode rows hold up to 1 + num_speculative_tokens tokens each
    num_speculative_tokens: int = 0


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

    def wrap_forward(self, forward: Callable[..., Any], limits: RunnerLimits) -> Callable[..., Any]:
        """Return a replacement for the model forward, same signature and results (e.g. one that
        replays captured graphs). ``limits`` may be left out of the signature (API 1.0/1.1 hooks
        take only ``forward``). Not called under ``--enforce-eager``.

        The replacement may have a method ``warm_up(kv_caches, device)``, which the runner
        calls once the KV cache is allocated, before the first step (e.g. to capture graphs
        then rather than during the first requests).

        It may set ``uniform_drafts = True`` (API 1.13) where it runs a step faster when every
        sequence in it verifies exactly ``limits.num_speculative_tokens`` drafts (one graph per
        batch size for that shape): the engine then pads each decoding sequence's drafts to
        that many, as far as its ``max_tokens`` and ``max_model_len`` allow (a filler draft is
        one more guess, verified like the others).

        It may have ``attach_head(head)`` and ``with_head(ids, positions, kv_caches, meta)``
        (API 1.18): the runner attaches the model's head (``compute_logits(hidden, None)``: the
        logits of every row) before ``warm_up``, and for a step every row of which samples, in
        order (a decode step), calls ``with_head`` for ``(hidden, logits)`` at once (a graph
        holding both), or None where it does not take the step (the runner then runs the
        forward and the head). Not attached under tensor parallelism.

        With the head attached it may have ``attach_sampler(sample_async)`` and
        ``with_sample(ids, positions, kv_caches, meta, batch)`` (API 1.20): the runner attaches
        its op table's ``sample_async`` (the replacement answers whether it will draw with it:
        one it cannot hold, e.g. another package's pinned by ``--op``, it leaves to the runner),
        and for a decode step whose batch the runner completes before the forward (no grammar
        bitmask filled later) calls ``with_sample`` for ``(hidden, logits, pending)``: the
        step's draw as ``sample_async`` would make it, or None as ``pending`` where the runner is
        to sample the logits itself; None for the whole where it does not take the step.

        A replacement that draws may also have ``advance_sample(batch)`` (API 1.21): right after
        a call whose draw it returned (``with_sample``'s or this one's), the runner may ask it
        for the next decode step of the same sequences, each one position further and fed the
        token just drawn for it, sampled with ``batch`` (the last step's, each row's step index
        one further): the step's draw, as ``pending``, or None where it will not run it (the
        runner builds and launches the step). The engine does so for the later steps of a round
        (``--num-scheduler-steps``), whose blocks it reserved before the round's first step."""
        ...
