"""From text to the token ids the engine core takes, as every front end (``LLM``, ``fd serve``)
does it: the text checked where it enters, a hopeless length refused before any tokenizing."""

from __future__ import annotations

from typing import Any

from fd_core.errors import PromptTooLongError, check_text


def encode_prompt(tokenizer: Any, text: str, max_model_len: int | None, field: str = "prompt",
                  add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text)``, refusing text that is not valid Unicode (naming ``field``) or
    that cannot fit ``max_model_len`` tokens whatever it holds (``PromptTooLongError``, at once:
    tokenizing 10 MB takes seconds); None: no bound (a prompt to be truncated)."""
    check_text(field, text)
    bound = getattr(tokenizer, "min_token_count", None)  # optional in the Tokenizer protocol
    if bound is not None and max_model_len is not None and len(text) >= max_model_len:
        at_least = bound(text)
        if at_least >= max_model_len:
            raise PromptTooLongError(
                f"the {field} has {len(text)} characters, at least {at_least} tokens, which leaves no room "
                f"to generate within max_model_len={max_model_len}"
            )
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
