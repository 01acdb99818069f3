"""Sequence: one stream of tokens the engine core is generating."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from fd_core.engine.sampling_params import SamplingParams

PLACEHOLDER = -1  # an output token the host has not read yet (asynchronous scheduling)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV blocks in host memory; waiting to come back
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The unit the scheduler and block pool work on; a request with ``n`` outputs has ``n``.

    ``num_computed`` counts tokens whose K/V are in the cache. A step computes
    ``tokens[num_computed : num_computed + k]``; when that reaches the end of ``tokens`` the step
    also samples the next token. After a preemption by recompute ``num_computed`` goes back to 0
    and the whole sequence (prompt and generated tokens) is prefilled again, less whatever the
    prefix cache still holds; after a preemption by swap it keeps ``num_computed`` and its
    blocks wait in host memory (``host_blocks``).

    The ``n`` outputs of a request start as one sequence: the others wait in ``forks`` until it
    has computed the prompt. Those the scheduler seats in that step sample their first token from
    its logits and share its blocks; the others queue alone and compute the prompt themselves.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int  # order of arrival; lower runs first and is preempted last
    output_token_ids: list[int] = field(default_factory=list)
    # Only ever extended in place; any other change assigns a new list, which is what lets the
    # executor keep each table's host row from step to step (engine/block_rows.py)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    max_tokens: int = 16
    num_preemptions: int = 0
    cache_salt: str | None = None  # isolates this request's prefix-cache entries from others'
    block_hashes: list[bytes] = field(default_factory=list)  # memo of its full blocks' hashes
    num_committed_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = -1  # prompt tokens the prefix cache supplied; -1 until admitted
    host_blocks: list[int] = field(default_factory=list)  # while SWAPPED
    forks: list[Sequence] = field(default_factory=list, repr=False)  # siblings awaiting the prompt
    fork_of: Sequence | None = field(default=None, repr=False)
    # time.monotonic() in the core when it was queued and first scheduled, for the latency metrics
    queued_at: float = 0.0
    scheduled_at: float | None = None
    grammar: Any = None  # its structured output's Grammar (engine.structured.matchers), advanced on every token
    # its request's allowed_token_ids as one row of a token bitmask (int32), shared by its n outputs
    allowed_tokens: Any = None
    bad_words: tuple[tuple[int, ...], ...] = ()  # token ids (fd_core.engine.bad_words)
    # its next step's sampling reads its output so far on the host (penalties, a bad word of
    # several tokens), so its step is read before the next is scheduled (asynchronous scheduling)
    reads_history: bool = False
    # prompt_logprobs: prompt tokens scored so far, the first (which has none) counted; None when
    # not asked (and for a request's forks: the first sequence scores the prompt for all)
    prompt_scored: int | None = None
    prompt_scores: list[Any] = field(default_factory=list, repr=False)  # what the steps computed, until sent
    # speculative decoding (engine/speculative): the tokens proposed to follow its output, which
    # its next step verifies; and how many of its leading tokens the proposer's own model (a
    # draft model, MTP layers) holds keys and values for in its cache layers
    draft_token_ids: list[int] = field(default_factory=list)
    proposer_computed: int = 0
    # prefill/decode disaggregation (fd_core.cluster.disaggregation): ``hand_over``, on a
    # prefill instance: once its first token is sampled it stops and waits, blocks held, for
    # its keys and values to be sent on (EngineCore.prefilled); ``kv_import``, on a decode
    # instance: its prompt's keys and values, computed elsewhere, per rank, written into its
    # blocks when it is admitted
    hand_over: bool = False
    kv_import: Any = field(default=None, repr=False)

    @property
    def owes_prompt_logprobs(self) -> bool:
        return self.prompt_scored is not None and self.prompt_scored < len(self.prompt_token_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building ``tokens`` (a decode step asks for one token of
        a long sequence, every step)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:end] + self.output_token_ids[: max(0, end - p)]

    def token_at(self, index: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < p else self.output_token_ids[index - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
