"""The engine's tokenizer: a ``tokenizers.Tokenizer`` plus special tokens and the chat template.

Every checkpoint format ends up here. GGUF metadata and sentencepiece ``tokenizer.model`` files are
turned into the same ``tokenizers`` pipelines that Hugging Face ``transformers`` builds from them,
because ``transformers`` is the reference our outputs are compared against.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from fd_core.loader.chat_template import render_chat_template, select_template

# Token kinds, numbered as sentencepiece and GGUF number them.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


class TextTokenizer:
    """Implements :class:`fd_core.loader.tokenizer_api.Tokenizer` over a ``tokenizers`` backend."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        chat_template: str | Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = self.token_to_id(bos_token)
        eos_ids = set(extra_eos_ids)
        eos_id = self.token_to_id(eos_token)
        if eos_id is not None:
            eos_ids.add(eos_id)
        self.eos_token_id: int | None = eos_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.pad_token_id: int | None = self.token_to_id(pad_token)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    # -- the protocol ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works and encode does not: a long prompt
        # tokenized in a server's worker thread must not stall its event loop (measured: a
        # 10 MB text holds the GIL for 13 s through encode)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_token_count(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))``, in O(1) for text without a normalizer: no
        token covers more characters than its vocabulary entry has (a byte-level entry has one
        character per byte). Lets a front end refuse a huge prompt without tokenizing it."""
        length = len(text)
        if self.backend.normalizer is not None and length > self._max_token_chars:
            length = len(self.backend.normalizer.normalize_str(text))  # it may compose characters
        return length // self._max_token_chars

    @cached_property
    def _max_token_chars(self) -> int:
        return max(1, max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """``decode`` of each, in one call into ``tokenizers`` (which spreads it over the cores)."""
        return self.backend.decode_batch([list(ids) for ids in batch], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the checkpoint's template.

        ``chat_template`` picks a named template (or passes one); ``tools``, ``documents`` and any other
        keyword become template variables. ``continue_final_message``: the text ends with the last
        message's content, left open (``render_chat_template``).
        """
        template = select_template(self.chat_template, kwargs.pop("chat_template", None), kwargs.get("tools"))
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    # -- helpers the engine uses around the protocol ------------------------------------------

    @property
    def special_tokens(self) -> dict[str, str | None]:
        return {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
        }

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(index for index, token in self.backend.get_added_tokens_decoder().items() if token.special)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self.backend.id_to_token(index)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(index) for index in ids]

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"TextTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"


# -- building blocks shared by the loaders -----------------------------------------------------


def add_special_tokens(backend: Tokenizer, tokens: Iterable[str | None]) -> None:
    """Make ``tokens`` match whole in raw text and count as special (skipped when decoding).

    A token the backend already lists as added keeps its flags, as transformers keeps them: a
    tokenizer.json that calls ``<think>`` non-special wins over a config listing it as special.
    """
    present = {token.content for token in backend.get_added_tokens_decoder().values()}
    wanted = []
    for token in tokens:
        if token and token not in present:
            present.add(token)
            wanted.append(AddedToken(token, normalized=False, special=True))
    if wanted:
        backend.add_special_tokens(wanted)


def add_plain_tokens(backend: Tokenizer, tokens: Iterable[str]) -> None:
    """Tokens matched whole in raw text but kept when decoding (``<think>`` and the like)."""
    wanted = [AddedToken(token, normalized=False, special=False) for token in tokens]
    if wanted:
        backend.add_tokens(wanted)


def set_bos_eos(backend: Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """Install the post-processor that wraps an encoding in BOS/EOS as the flags say."""
    add_bos = add_bos and bos is not None and backend.token_to_id(bos) is not None
    add_eos = add_eos and eos is not None and backend.token_to_id(eos) is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    special = []
    if add_bos:
        special.append((bos, backend.token_to_id(bos)))
    if add_eos and eos != bos:
        special.append((eos, backend.token_to_id(eos)))
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def merges_from_vocab(vocab: Mapping[str, int], scores: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """Recover BPE merges from a vocabulary that lists none (sentencepiece BPE, GGUF "llama").

    Every way of cutting a token into two tokens of the vocabulary is a merge. Merges rank by the
    score of the token they make, best first, or without scores by that token's id, lowest first;
    ties go to the longer left piece, then the longer right piece. Within one token the cuts keep
    the order of their pieces' ids. This is the order ``transformers`` derives, so both tokenize alike.
    """
    ranked: list[tuple[float, int, int, str, str]] = []
    keys = scores if scores is not None else vocab
    for token, key in keys.items():
        cuts = []
        for split in range(1, len(token)):
            left, right = token[:split], token[split:]
            if left in vocab and right in vocab:
                cuts.append((vocab[left], vocab[right], left, right))
        cuts.sort(key=lambda cut: (cut[0], cut[1]))
        ranked.extend((key, len(left), len(right), left, right) for _, _, left, right in cuts)
    descending = scores is not None
    ranked.sort(key=lambda item: (item[0], item[1], item[2]), reverse=descending)
    return [(left, right) for _, _, _, left, right in ranked]


def sentencepiece_bpe(
    tokens: Sequence[str],
    types: Sequence[int] | None,
    *,
    scores: Sequence[float] | None = None,
    merges: Sequence[tuple[str, str]] | None = None,
) -> Tokenizer:
    """A sentencepiece-style BPE (``▁`` for spaces, byte fallback) as ``transformers``' LlamaTokenizer builds it.

    The text gets one ``▁`` in front of its first piece only; control tokens (and user-defined ones)
    are matched whole before the model sees the text.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is None:
        merges = merges_from_vocab(vocab, dict(zip(tokens, scores, strict=True)) if scores is not None else None)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=True, byte_fallback=True, dropout=None))
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    kinds = list(types or ())
    add_special_tokens(backend, (tok for tok, kind in zip(tokens, kinds, strict=False) if kind == CONTROL))
    add_plain_tokens(backend, [tok for tok, kind in zip(tokens, kinds, strict=False) if kind == USER_DEFINED])
    return backend


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes stand for themselves; the other 68 take the code points from U+0100 on,
    in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {byte: chr(byte) for byte in keep}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table
