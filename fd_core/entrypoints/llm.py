"""The offline API: ``LLM(model=...).generate(...)`` and ``.chat(...)``, engine in-process."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from fd_core.engine.config import EngineConfig
from fd_core.engine.engine import LLMEngine
from fd_core.engine.outputs import RequestOutput
from fd_core.engine.prompts import encode_prompt
from fd_core.engine.sampling_params import SamplingParams
from fd_core.errors import InvalidRequestError
from fd_core.loader import DEFAULT_MODEL
from fd_core.logs import configure_default
from fd_core.phases import bar

PromptLike = str | list[int] | dict[str, Any]
Messages = list[dict[str, str]]


class LLM:
    """Load a model once and generate for many prompts together (continuous batching).

    ``skip_tokenizer_init=True`` loads no tokenizer (the model folder needs none): prompts are
    token ids (``{"prompt_token_ids": [...]}`` or lists) and outputs carry token ids, no text.

    Keyword arguments are :class:`~fd_core.engine.config.EngineConfig` fields
    (``device``, ``runtime`` (e.g. ``"torch"`` on the CPU; default: the backend's),
    ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``block_size``, ``num_kv_blocks``, ``kv_cache_memory_gb``, ``seed``, ``op_pins``...).
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        configure_default()  # fd's log lines, unless the application has set up logging
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        fields = {k: v for k, v in vars(config).items() if k != "model"}
        return cls(model=config.model, **fields)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix no request is using (e.g. between benchmark runs);
        returns how many KV-cache blocks were dropped."""
        return self.engine.pool.reset_prefix_cache()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many. A prompt is a string, a list of token ids, or a
        dict with ``prompt`` or ``prompt_token_ids``. Outputs come back in input order."""
        items = self._as_list(prompts)
        return self._run([self._unpack(p) for p in items], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or many, rendered with the model's chat template.
        ``continue_final_message`` (with ``add_generation_prompt=False``): the model goes on with
        the last message instead of starting a new one, as in vLLM."""
        if self.engine.tokenizer is None:
            raise InvalidRequestError("chat needs a tokenizer, and this engine has none (skip_tokenizer_init)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            for m in conv:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise InvalidRequestError(f"each message needs 'role' and 'content', got {m!r}")
            text = tok.apply_chat_template(list(conv), add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message,
                                           **(chat_template_kwargs or {}))
            # the template already placed any BOS it wants
            prompts.append((text, encode_prompt(tok, text, self.engine.max_model_len, "messages",
                                                add_special_tokens=False)))
        return self._run(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _as_list(prompts: Any) -> list[Any]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of those")
        return list(prompts)

    def _unpack(self, prompt: Any) -> tuple[str | None, str | list[int]]:
        if isinstance(prompt, str):
            return prompt, prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], prompt["prompt"]
        if isinstance(prompt, (list, tuple)):
            return None, prompt  # token ids: the engine checks and converts them
        raise InvalidRequestError(f"cannot use {type(prompt).__name__} as a prompt")

    def _run(self, prompts: list[tuple[str | None, str | list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(
                    f"{len(params)} sampling params for {len(prompts)} prompts; give one or one each"
                )
        ids = []
        try:
            for (text, prompt), p in zip(prompts, params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, prompt_text=text)
                ids.append(rid)
        except Exception:
            for rid in ids:  # nothing half-submitted stays in the engine
                self.engine.abort_request(rid)
            raise
        shown = bar(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            done = self.engine.run(progress=shown)
        except BaseException:
            for rid in ids:  # an interrupted call leaves no half-run request holding KV blocks
                self.engine.abort_request(rid)
            raise
        finally:
            shown.close()
        return [done[rid] for rid in ids]
