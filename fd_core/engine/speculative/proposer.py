"""Proposers: after a step, each decoding sequence gets the tokens it will verify next
(``Sequence.draft_token_ids``), at most ``num_speculative_tokens`` and never past its
``max_tokens`` or the engine's ``max_model_len``.

``NgramProposer`` looks them up in the sequence itself (``ngram.py``). A proposer with a model
of its own (a draft model, MTP layers) keeps that model's keys and values in the target's
blocks (``holds_kv``): it computes, after each step, what the target computed in it, then its
drafts (``model.py``).
"""

from __future__ import annotations

import weakref
from typing import Protocol

import numpy as np

from fd_core.engine.scheduler import ScheduledSeq
from fd_core.engine.sequence import Sequence
from fd_core.engine.speculative import ngram
from fd_core.engine.speculative.config import SpeculativeConfig


class Proposer(Protocol):
    holds_kv: bool

    def propose(self, scheduled: list[ScheduledSeq], decoding: list[Sequence]) -> None:
        """After a step whose tokens are recorded in the sequences (and before its blocks are
        published): set ``draft_token_ids`` of sequences in ``decoding`` (each one of
        ``scheduled`` that sampled; the engine has emptied theirs)."""
        ...


def room(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts ``seq`` may verify next step: all ``k + 1`` tokens it could then emit
    fit its ``max_tokens`` and ``max_model_len``."""
    return max(0, min(k, seq.max_tokens - len(seq.output_token_ids) - 1, max_model_len - seq.num_tokens - 1))


def wants_drafts(seq: Sequence) -> bool:
    """Whether ``seq`` verifies drafts: not under a grammar, whose masks follow one token a
    step (its rows would need the matcher advanced along each draft)."""
    return seq.grammar is None


def pad_drafts(decoding: list[Sequence], k: int, max_model_len: int) -> None:
    """Give each sequence that verifies drafts ``k`` of them where its limits allow, repeating
    its last draft (or its last token): for a backend whose verification steps run fastest in
    one shape (``ModelRunner.pads_drafts``), where a filler costs nothing more and is one more
    guess, verified like the others."""
    for seq in decoding:
        if not wants_drafts(seq) or seq.finished:
            continue
        drafts = seq.draft_token_ids
        want = room(seq, k, max_model_len)
        if len(drafts) < want:
            filler = drafts[-1] if drafts else seq.token_at(seq.num_tokens - 1)
            seq.draft_token_ids = drafts + [filler] * (want - len(drafts))


class NgramProposer:
    """Prompt lookup over each sequence's tokens, kept per sequence as a NumPy array that grows
    with its output (a step converts only the new tokens, not the whole sequence)."""

    holds_kv = False

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len
        self._tokens: weakref.WeakKeyDictionary[Sequence, list] = weakref.WeakKeyDictionary()

    def propose(self, scheduled: list[ScheduledSeq], decoding: list[Sequence]) -> None:
        for seq in decoding:
            k = room(seq, self.k, self.max_model_len) if wants_drafts(seq) else 0
            seq.draft_token_ids = ngram.propose(self._history(seq), k, self.low, self.high) if k else []

    def _history(self, seq: Sequence) -> np.ndarray:
        memo = self._tokens.get(seq)
        if memo is None:
            memo = self._tokens[seq] = [np.empty(self.max_model_len, dtype=np.int64), 0]
        array, have = memo
        end = seq.num_tokens
        if end > have:
            array[have:end] = seq.tokens_between(have, end)
            memo[1] = end
        return array[:end]

