"""The engine's side of structured output: an llguidance matcher per constrained sequence.

A matcher is made from its grammar's compiled template (one per distinct grammar, kept in a
bounded cache: copying one costs microseconds, compiling one about a millisecond), advanced
by every token its sequence samples, and asked each step for the row's allowed-token bitmask.

A step's rows are filled in one call to llguidance's executor, which computes them without
the GIL on a pool of ``POOL`` threads: one call rather than a call per row lets the engine's
thread run while the rows are computed on another (``worker``). Copies of one compiled
template share state, on which the pool serialises (measured on an H100 host, 16 cores,
SmolLM2, 32 JSON rows a step: 1.3-1.6 ms a step with 1 to 8 threads; docs/PERFORMANCE.md,
"Structured output"), so each grammar is compiled once per pool thread, and its requests take
copies of those templates in turn.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fd_core.engine.structured.params import StructuredOutputsParams
from fd_core.errors import InvalidRequestError
from fd_core.host import usable_cpus
from fd_core.interfaces import SamplingBatch
from fd_core.interfaces.ops import token_bitmask_words

log = logging.getLogger("fd.engine")

MAX_TEMPLATES = 256  # distinct grammars kept compiled
# llguidance's pool: half the cores this process may run on, at most 8 (a 2-core machine fills
# on one thread)
POOL = max(1, min(8, usable_cpus() // 2))


class Grammar:
    """A sequence's grammar: its llguidance matcher and, while the grammar waits for its start
    (``StructuredOutputsParams.starts_after``, e.g. a reasoning model's end of thought), the
    tokens that wake it and the last tokens seen."""

    __slots__ = ("after", "matcher", "tail")

    def __init__(self, matcher: Any, after: tuple[int, ...] = ()) -> None:
        self.matcher = matcher
        self.after = after
        self.tail: tuple[int, ...] = ()

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the sequence's next token."""
        return not self.after

    def fork(self) -> Grammar:
        """The same grammar for another output of the request, in the same state."""
        copy = Grammar(self.matcher.deep_copy(), self.after)
        copy.tail = self.tail
        return copy

    def advance(self, token: int) -> str | None:
        """Take the sequence's next token; why the sequence ends there, if it does: ``"stop"``
        when the grammar is complete (nothing may follow), ``"abort"`` when the token broke it
        (a backend that ignored the mask). While the grammar waits for its start the token is
        only noted, and the grammar wakes after its trigger."""
        if self.after:
            self.tail = (self.tail + (token,))[-len(self.after):]
            if self.tail == self.after:  # the next token is the first the grammar holds
                self.after = ()
            return None
        if not self.matcher.consume_token(token):
            log.error("a sampled token broke its sequence's grammar (%s); the backend's sample op did not "
                      "apply the allowed-token bitmask", self.matcher.get_error())
            return "abort"
        return "stop" if self.matcher.is_stopped() else None


class GrammarMatchers:
    """Compiles grammars against the model's tokenizer and fills a step's bitmask.

    ``tokenizer``: fd's tokenizer (a ``tokenizers`` backend); ``vocab_size``: the width of the
    model's logits, which may exceed the tokenizer's (padding): the tokens past it are never
    allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        from llguidance import LLExecutor, LLTokenizer

        self.vocab_size = vocab_size
        self.words = token_bitmask_words(vocab_size)
        try:
            self._lltokenizer = LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                            eos_token=sorted(int(t) for t in eos_token_ids) or None)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer model llguidance does not read
            raise InvalidRequestError(f"structured output is unavailable: llguidance could not read this "
                                      f"model's tokenizer ({type(exc).__name__}: {exc})") from None
        self._executor = LLExecutor(num_threads=POOL)
        self.pool = POOL
        # a grammar's templates (up to one per pool thread) and how many copies were made
        self._templates: OrderedDict[str, tuple[list[Any], list[int]]] = OrderedDict()
        # host time spent on masks and compiling, for benchmarks/structured_output.py
        self.fill_seconds = 0.0
        self.fills = 0
        self.compile_seconds = 0.0

    def grammar(self, params: StructuredOutputsParams, after: tuple[int, ...] = ()) -> Grammar:
        """A fresh grammar for ``params``, waiting for the tokens ``after`` if there are any: a
        copy of one of its templates, taken in turn, each compiled when first needed."""
        from llguidance import LLMatcher

        entry = self._templates.get(params.spec)
        if entry is None:
            entry = self._templates[params.spec] = ([], [0])
            if len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(params.spec)
        templates, made = entry
        turn = made[0] % self.pool
        made[0] += 1
        if turn == len(templates):
            start = time.perf_counter()
            template = LLMatcher(self._lltokenizer, params.spec, log_level=0)
            self.compile_seconds += time.perf_counter() - start
            if template.is_error():  # what needs the tokenizer: e.g. a grammar no token can start
                del self._templates[params.spec]
                raise InvalidRequestError(
                    f"structured_outputs.{params.kind} cannot be used with this model: {template.get_error()}",
                    param=f"structured_outputs.{params.kind}")
            templates.append(template)
        return Grammar(templates[turn].deep_copy(), after)

    @staticmethod
    def constrained(seqs: Sequence[Any]) -> list[tuple[Grammar, int]]:
        """``(grammar, row)`` for each row of ``seqs`` whose grammar holds its next token."""
        return [(seq.grammar, row) for row, seq in enumerate(seqs) if seq.grammar is not None and seq.grammar.active]

    def fill_rows(self, rows: list[tuple[Grammar, int]], mask: np.ndarray, base: np.ndarray | None) -> None:
        """Write the allowed tokens of each ``(grammar, row)`` whose grammar holds its next
        token (one still waiting for its start is left out) into ``mask`` (int32 ``[S, words]``,
        C-contiguous), intersected with ``base``'s row where there is one (the request's own
        ``allowed_token_ids``); the other rows are ``base``'s, or all allowed."""
        start = time.perf_counter()
        rows = [(g, row) for g, row in rows if g.active]
        if base is None:
            mask.fill(-1)
        else:
            np.copyto(mask, base)
        if rows:
            self._executor.unsafe_compute_mask_ptr([(g.matcher, row) for g, row in rows], mask.ctypes.data,
                                                   self.words * 4, len(mask))
            if base is not None:
                index = [row for _, row in rows]
                mask[index] &= base[index]
        self.fill_seconds += time.perf_counter() - start
        self.fills += 1

    def fill(self, seqs: Sequence[Any], batch: SamplingBatch) -> None:
        """Narrow ``batch.allowed_token_bitmask`` to the grammar of each row of ``seqs`` whose
        grammar holds its next token. A mask already there (``allowed_token_ids``) is kept
        and intersected; with neither, there is no mask."""
        rows = self.constrained(seqs)
        if not rows:
            return
        base = batch.allowed_token_bitmask
        mask = np.empty((len(seqs), self.words), dtype=np.int32)
        self.fill_rows(rows, mask, base)
        batch.allowed_token_bitmask = mask
