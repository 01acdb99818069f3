"""Incremental detokenization and stop-string handling, in the front end.

Text is produced by decoding a short window of recent tokens and emitting only what the newest
token added, so the cost per token is constant and multi-token characters (UTF-8 split across
byte-level tokens) are emitted only once complete.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fd_core.engine.sampling_params import SamplingParams
from fd_core.loader.tokenizer_api import Tokenizer

# How many tokens before the unread ones are decoded again for context: enough for any
# tokenizer whose decode of a token depends on its neighbours (leading-space rules, bytes).
_CONTEXT = 6


@dataclass
class TextState:
    """The text side of one output sequence."""

    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    # every prefix of up to this many tokens past read_offset renders nothing new (under the
    # same offsets): catch_up need not decode them again
    checked: int = 0

    def __post_init__(self) -> None:
        # the prompt text is never part of the output: start decoding just past it
        n = len(self.prompt_token_ids)
        self.prefix_offset = max(0, n - _CONTEXT)
        self.read_offset = self.checked = n

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_from(self, start: int) -> list[int]:
        """``(prompt + output)[start:]`` without copying the whole prompt every token."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p :]
        return self.prompt_token_ids[start:] + self.output_token_ids


def append_text(tokenizer: Tokenizer, state: TextState) -> str:
    """Decode the newest token of ``state`` into ``state.text``; returns the text it added."""
    window = state.tokens_from(state.prefix_offset)
    skip = state.params.skip_special_tokens
    before = tokenizer.decode(window[: state.read_offset - state.prefix_offset], skip_special_tokens=skip)
    return _advance(state, before, tokenizer.decode(window, skip_special_tokens=skip))


def _advance(state: TextState, before: str, after: str) -> str:
    """``append_text`` once the window's two decodes are known."""
    num_tokens = state.num_tokens
    if after.endswith("\ufffd") or len(after) <= len(before):
        if num_tokens == state.checked + 1:
            state.checked = num_tokens
        return ""  # an incomplete character, or a token that renders as nothing yet
    new = after[len(before) :]
    state.prefix_offset = max(state.read_offset, num_tokens - _CONTEXT)
    state.read_offset = state.checked = num_tokens
    state.text += new
    return new


def catch_up(tokenizer: Tokenizer, state: TextState) -> str:
    """Decode every token not read yet into ``state.text``, as ``append_text`` after each one
    would have; returns the text added. At once where they end on a whole character (the
    usual case), else token by token, past the prefixes already known to render nothing (a
    stream of bytes that never completes a character, a degenerate model's, would otherwise
    decode every pending prefix again at every step)."""
    if tokenizer is None:  # skip_tokenizer_init: outputs are token ids alone
        return ""
    unread = state.num_tokens - state.read_offset
    if unread <= 1:
        return append_text(tokenizer, state) if unread else ""
    start = len(state.text)
    if not append_text(tokenizer, state):  # they end inside a character, or render as nothing
        _token_by_token(tokenizer, state, unread)
    return state.text[start:]


def catch_up_all(tokenizer: Tokenizer, states: list[TextState]) -> None:
    """``catch_up`` for many sequences: their first attempts decoded together, the windows
    before and after the unread tokens in one batch call (``decode_batch`` where the tokenizer has one:
    ``tokenizers`` enters Rust once and spreads a batch over the cores; the final text of 128
    outputs of 128 tokens took 18-32 ms one by one on an H200 host, 9-10 batched, the GPU idle). The rare
    sequence whose tokens end inside a character goes on token by token as ``catch_up`` does."""
    pending = list({id(s): s for s in states if s.num_tokens > s.read_offset}.values())
    if tokenizer is None or not pending:
        return
    windows = [s.tokens_from(s.prefix_offset) for s in pending]
    befores = [w[: s.read_offset - s.prefix_offset] for w, s in zip(windows, pending)]
    skips = [s.params.skip_special_tokens for s in pending]
    texts = _decode_all(tokenizer, befores + windows, skips + skips)
    n = len(pending)
    for state, before, after in zip(pending, texts[:n], texts[n:]):
        unread = state.num_tokens - state.read_offset
        if not _advance(state, before, after) and unread > 1:
            _token_by_token(tokenizer, state, unread)


def _decode_all(tokenizer: Tokenizer, windows: list[list[int]], skips: list[bool]) -> list[str]:
    """Each window decoded, one batch call a ``skip_special_tokens`` value where the tokenizer
    has ``decode_batch`` (an optional addition to the protocol), else one call a window."""
    batch = getattr(tokenizer, "decode_batch", None)
    if batch is None:
        return [tokenizer.decode(w, skip_special_tokens=skip) for w, skip in zip(windows, skips)]
    texts = [""] * len(windows)
    for flag in set(skips):
        where = [i for i, skip in enumerate(skips) if skip == flag]
        for i, text in zip(where, batch([windows[i] for i in where], skip_special_tokens=flag)):
            texts[i] = text
    return texts


def _token_by_token(tokenizer: Tokenizer, state: TextState, unread: int) -> None:
    """The last ``unread`` tokens read again one at a time, skipping the prefixes already known
    to render nothing."""
    tokens = state.output_token_ids
    rest = tokens[len(tokens) - unread:]
    del tokens[len(tokens) - unread:]
    for token in rest:
        tokens.append(token)
        if state.num_tokens > state.checked:
            append_text(tokenizer, state)


def find_stop(state: TextState, new_text_len: int) -> str | None:
    """If a stop string now appears in the output, cut the text there and return it.

    Only the tail that could contain a new match is searched: the new text plus one stop
    string's length before it."""
    stops = state.params.stop_strings
    if not stops or not new_text_len:
        return None
    for stop in stops:
        begin = max(0, len(state.text) - new_text_len - len(stop) + 1)
        at = state.text.find(stop, begin)
        if at != -1:
            end = at + len(stop) if state.params.include_stop_str_in_output else at
            state.text = state.text[:end]
            return stop
    return None


def stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could still become a stop string; a stream
    holds them back so a stop string is never sent in part before it is cut."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:k]):
                hold = k
                break
    return hold
