"""The engine's side of structured output: an llguidance matcher per constrained sequence.

A matcher is made from its grammar's compiled template (one per distinct grammar, kept in a
bounded cache: copying one costs microseconds, compiling one about a millisecond), advanced
by every token its sequence samples, and asked each step for the row's allowed-token bitmask,
while the step's forward runs on a GPU (``ModelRunner``).

The rows are filled one after another on the engine's thread. Measured on an H100 host (16
cores, SmolLM2, 32 JSON rows a step; docs/PERFORMANCE.md, "Structured output"): llguidance's
thread pool (``LLExecutor``) does not scale over copies of one template, which share state
(1.3-1.6 ms a step with 1 to 8 threads against 1.4 ms one after another), and a grammar thread
that followed each step off the engine's thread cost more in hand-overs than it overlapped.
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
from fd_core.interfaces import SamplingBatch
from fd_core.interfaces.ops import token_bitmask_words

log = logging.getLogger("fd.engine")

MAX_TEMPLATES = 256


class GrammarMatchers:
    """Compiles grammars against the model's tokenizer and fills a step's bitmask.

    ``tokenizer``: fd's tokenizer (a ``tokenizers`` backend); ``vocab_size``: the width of the
    model's logits, which may exceed the tokenizer's (padding): the tokens past it are never
    allowed."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.words = token_bitmask_words(vocab_size)
        try:
            self._lltokenizer = LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                            eos_token=sorted(int(t) for t in eos_token_ids) or None)
        except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer model llguidance does not read
            raise InvalidRequestError(f"structured output is unavailable: llguidance could not read this "
                                      f"model's tokenizer ({type(exc).__name__}: {exc})") from None
        self._templates: OrderedDict[str, Any] = OrderedDict()
        # host time spent on masks and compiling, for benchmarks/structured_output.py
        self.fill_seconds = 0.0
        self.fills = 0
        self.compile_seconds = 0.0

    def matcher(self, params: StructuredOutputsParams) -> Any:
        """A fresh matcher for ``params``' grammar (compiled on first use, then copied)."""
        from llguidance import LLMatcher

        template = self._templates.get(params.spec)
        if template is None:
            start = time.perf_counter()
            template = LLMatcher(self._lltokenizer, params.spec, log_level=0)
            self.compile_seconds += time.perf_counter() - start
            if template.is_error():  # what needs the tokenizer: e.g. a grammar no token can start
                raise InvalidRequestError(
                    f"structured_outputs.{params.kind} cannot be used with this model: {template.get_error()}",
                    param=f"structured_outputs.{params.kind}")
            self._templates[params.spec] = template
            if len(self._templates) > MAX_TEMPLATES:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(params.spec)
        return template.deep_copy()

    def fill(self, seqs: Sequence[Any], batch: SamplingBatch) -> None:
        """Narrow ``batch.allowed_token_bitmask`` to the grammar of each row of ``seqs`` that has
        a matcher (``seq.grammar``) not waiting to start (``seq.grammar_after``). A mask already
        there (``allowed_token_ids``) is kept and intersected; with neither, there is no mask."""
        rows = [(seq.grammar, row) for row, seq in enumerate(seqs) if seq.grammar is not None and not seq.grammar_after]
        if not rows:
            return
        start = time.perf_counter()
        base = batch.allowed_token_bitmask
        mask = np.full((len(seqs), self.words), -1, dtype=np.int32) if base is None else base
        scratch = np.empty(self.words, dtype=np.int32)
        for matcher, row in rows:
            view = mask[row] if base is None else scratch
            matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
            if base is not None:
                mask[row] &= scratch
        batch.allowed_token_bitmask = mask
        self.fill_seconds += time.perf_counter() - start
        self.fills += 1

    def advance(self, matcher: Any, token: int) -> str | None:
        """Consume ``token``; the reason the sequence ends here, if it does: ``"stop"`` when the
        grammar is complete (nothing may follow), ``"abort"`` when the token broke it (a backend
        that ignored the mask)."""
        if not matcher.consume_token(token):
            log.error("a sampled token broke its sequence's grammar (%s); the backend's sample op did not "
                      "apply the allowed-token bitmask", matcher.get_error())
            return "abort"
        return "stop" if matcher.is_stopped() else None
