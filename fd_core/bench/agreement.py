"""How closely an engine's greedy continuations follow a reference's (the same model with another
KV-cache format, weight format or backend).

* ``free_running``: the continuations each engine generates on its own. One flipped near-tie
  changes everything after it, so this measures the model's sensitivity as much as the format.
* ``teacher_forced``: the reference's continuation is prefilled after its prompt, and each
  position's greedy choice is compared with the reference's next token, the history being the
  same for both: the per-step agreement, free of that chaos.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_core.bench.perplexity import prompt_logits


def free_running(reference: list[list[int]], other: list[list[int]]) -> tuple[float, float]:
    """``(share of identical continuations, share of tokens before the first difference)``."""
    identical = sum(a == b for a, b in zip(reference, other)) / len(reference)
    before = 0
    for a, b in zip(reference, other):
        before += next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    return identical, before / sum(map(len, reference))


def teacher_forced(llm: Any, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """Share of the reference's continuation tokens that ``llm`` chooses greedily given the
    prompt and the reference's tokens before them (one prefill per prompt; the engine must
    be idle, as for perplexity)."""
    agree = total = 0
    for prompt, continuation in zip(prompts, reference):
        logits = prompt_logits(llm, list(prompt) + list(continuation))
        chosen = logits[len(prompt) - 1 :].argmax(-1)
        agree += int((chosen == np.asarray(continuation)).sum())
        total += len(continuation)
    return agree / total
