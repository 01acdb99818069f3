"""Incremental detokenization and stop-string handling.

Text is produced by decoding a short window of recent tokens and emitting only what the newest
token added, so the cost per token is constant and multi-token characters (UTF-8 split across
byte-level tokens) are emitted only once complete.
"""

from __future__ import annotations

from fd_core.engine.sequence import Sequence
from fd_core.loader.tokenizer_api import Tokenizer

# How many tokens before the unread ones are decoded again for context: enough for any
# tokenizer whose decode of a token depends on its neighbours (leading-space rules, bytes).
_CONTEXT = 6


def start(seq: Sequence) -> None:
    """Point the decoder just past the prompt (the prompt text is never part of the output)."""
    n = len(seq.prompt_token_ids)
    seq.prefix_offset = max(0, n - _CONTEXT)
    seq.read_offset = n


def append_text(tokenizer: Tokenizer, seq: Sequence) -> str:
    """Decode the newest token of ``seq`` into ``seq.text``; returns the text it added."""
    tokens = seq.tokens
    skip = seq.params.skip_special_tokens
    before = tokenizer.decode(tokens[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    after = tokenizer.decode(tokens[seq.prefix_offset :], skip_special_tokens=skip)
    if after.endswith("\ufffd") or len(after) <= len(before):
        return ""  # an incomplete character, or a token that renders as nothing yet
    new = after[len(before) :]
    seq.prefix_offset = max(seq.read_offset, len(tokens) - _CONTEXT)
    seq.read_offset = len(tokens)
    seq.text += new
    return new


def find_stop(seq: Sequence, new_text_len: int) -> str | None:
    """If a stop string now appears in the output, cut the text there and return it.

    Only the tail that could contain a new match is searched: the new text plus one stop
    string's length before it."""
    stops = seq.params.stop_strings
    if not stops or not new_text_len:
        return None
    for stop in stops:
        begin = max(0, len(seq.text) - new_text_len - len(stop) + 1)
        at = seq.text.find(stop, begin)
        if at != -1:
            end = at + len(stop) if seq.params.include_stop_str_in_output else at
            seq.text = seq.text[:end]
            return stop
    return None
