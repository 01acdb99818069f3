"""``bad_words``: token sequences a request's output must never contain (vLLM's field).

A word is banned by banning its last token wherever the output so far ends with the tokens
before it, so only the step that would complete the word is constrained. Byte-level BPE
tokenizes a word differently at the start of a text and after a space, so both spellings are
banned. The bans reach the sampler as ``SamplingBatch.suppress_token_ids`` (any backend honours
those); a word of more than one token needs the previous tokens on the host, so its sequence
does not run ahead under asynchronous scheduling (``needs_history``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Word = tuple[int, ...]


def tokenize_bad_words(tokenizer: Any, words: Sequence[str]) -> tuple[Word, ...]:
    """Each word's token ids, as written (its leading spaces dropped) and after a space; distinct."""
    out: dict[Word, None] = {}
    for word in words:
        bare = word.lstrip()
        for text in (bare, " " + bare):
            ids = tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))
            if ids:
                out[ids] = None
    return tuple(out)


def needs_history(words: Sequence[Word]) -> bool:
    """Whether the bans depend on the output so far (a word of more than one token)."""
    return any(len(w) > 1 for w in words)


def banned(words: Sequence[Word], output: Sequence[int]) -> np.ndarray:
    """The tokens the next step must not sample (int64, sorted, distinct)."""
    out = []
    for word in words:
        head = len(word) - 1
        if head == 0 or (head <= len(output) and tuple(output[len(output) - head:]) == word[:-1]):
            out.append(word[-1])
    return np.unique(np.array(out, dtype=np.int64))
