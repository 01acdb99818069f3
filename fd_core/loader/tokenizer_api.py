"""The tokenizer interface the engine relies on, whatever file the tokenizer came from."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_ids: frozenset[int]  # every id that ends generation (eos, eot, im_end...)
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # Optional, not part of the protocol's check: ``decode_batch(batch, skip_special_tokens)``,
    # ``decode`` of each list at once; the output processor uses it where present
    # (``detokenizer.catch_up_all``).

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, **kwargs: object
    ) -> str:
        """Render a conversation with the model's own chat template; ``continue_final_message``:
        end with the last message's content, left open for the model to go on with."""
        ...
