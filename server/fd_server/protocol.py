"""The OpenAI wire format: request and response bodies of the endpoints fd serves.

Requests validate strictly (a string where a number belongs is a 400, as with OpenAI) but
ignore fields they do not know, so clients written for OpenAI or vLLM keep working. Ranges
written here are also in /openapi.json, so generated clients and fuzzers see them.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer, model_validator
from pydantic_core import PydanticCustomError

from fd_core.engine.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_BIAS,
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)
from fd_core.errors import lone_surrogate

# -- shared ----------------------------------------------------------------------------------

_REQUEST = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def _lone_surrogate(value: Any) -> str | None:
    """Where ``value`` (a string, or lists and dicts of them, keys included) holds a lone
    surrogate (``fd_core.errors.lone_surrogate``); None if nowhere."""
    if isinstance(value, str):
        return lone_surrogate(value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(key) or _lone_surrogate(item)
        if found:
            return found
    return None


def _unicode(value: Any) -> Any:
    found = _lone_surrogate(value)
    if found:
        raise PydanticCustomError("unicode", "not valid Unicode text: it holds a lone surrogate ({where})",
                                  {"where": found})
    return value


# Text from the client: it must be valid Unicode (see _lone_surrogate); JSON, the same for free-form values
Text = Annotated[str, AfterValidator(_unicode)]
Json = Annotated[Any, AfterValidator(_unicode)]
JsonObject = Annotated[dict[str, Json], AfterValidator(_unicode)]  # its keys checked too
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]
# JSON object keys are strings: a token id in decimal (SamplingParams parses it and bounds it)
BiasedToken = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool = False


class PromptTokensDetails(BaseModel):
    # prompt tokens whose KV cache the prefix cache supplied (counted once per prompt, whatever n)
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class JsonSchemaFormat(BaseModel):
    model_config = _REQUEST
    name: Text
    description: Text | None = None
    schema_: JsonObject | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _REQUEST
    type: Text = Field("text", description="text, json_object or json_schema")
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    json_: JsonObject | Text | None = Field(None, alias="json", description="a JSON schema")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = Field(None, description="Lark, or GBNF as llama.cpp writes it")
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class SamplingFields(BaseModel):
    """Fields both generation endpoints share."""

    model_config = _REQUEST

    model: Text
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_INT, description="-1 or 0: off; at least the vocabulary size: every token")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    user: Text | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_INT)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Text | None = Field(
        None, min_length=1,
        description="Only requests with the same salt share cached prompt prefixes (e.g. one salt per tenant).")
    # structured output (fd_server.structured): OpenAI's, vLLM's, and vLLM's older spelling
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None
    guided_decoding_backend: Text | None = Field(None, description="ignored: fd has one grammar engine (llguidance)")
    prompt_logprobs: int | None = Field(
        None, ge=-1, le=MAX_INT,
        description="vLLM's: the logprob of every prompt token after the first and the top k of its position, "
                    "k at most --max-logprobs (-1, the whole vocabulary, is refused)")
    logit_bias: dict[BiasedToken, Bias] | None = Field(
        None, max_length=MAX_LOGIT_BIAS,
        description=f"token id (a decimal string) -> bias in [-{MAX_BIAS:g}, {MAX_BIAS:g}] added to its logit before "
                    f"sampling; at most {MAX_LOGIT_BIAS} tokens")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[StopString] | None = Field(None, max_length=MAX_BAD_WORDS)
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, le=MAX_INT,
        description="vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len), applied after "
                    "the chat template and tokenization")
    add_special_tokens: bool | None = Field(
        None, description="add the tokenizer's special tokens (BOS) to the prompt; default: false in chat "
                          "(the template places them), true in completions")
    return_token_ids: bool = Field(False, description="the prompt's and the output's token ids beside the text "
                                                    "(vLLM's; streamed: the prompt's in the first chunk, each "
                                                    "chunk's own)")
    # fields of OpenAI and vLLM that would change the output and that fd does not honour: a
    # value other than the neutral one is refused by name (fd_server.refused)
    use_beam_search: Json = None
    length_penalty: Json = None
    logits_processors: Json = None
    spaces_between_special_tokens: Json = None
    return_tokens_as_token_ids: Json = None
    priority: Json = None
    kv_transfer_params: Json = None
    vllm_xargs: Json = None
    mm_processor_kwargs: Json = None
    media_io_kwargs: Json = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob, as its ``prompt_logprobs`` carry it."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: None for the first prompt token, then {token id: its Logprob and the top k}
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class _IfAsked(BaseModel):
    """A response part with vLLM's fields that only a request asking for them gets
    (``prompt_logprobs``; ``prompt_token_ids`` and ``token_ids`` with ``return_token_ids``),
    left out of the JSON where None, so that other responses keep OpenAI's shape."""

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("prompt_logprobs", "prompt_token_ids", "token_ids"):
            if out.get(key, 0) is None:
                del out[key]
        return out


# -- chat completions ------------------------------------------------------------------------


class _FreeForm(BaseModel):
    """A model whose extra keys pass through (to the chat template): they must be valid text too."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _extras_are_unicode(self) -> "_FreeForm":
        _unicode(self.model_extra)
        return self


class ContentPart(_FreeForm):
    type: Text
    text: Text | None = None


class ChatMessage(_FreeForm):
    """One message of a conversation. Extra keys (``tool_calls``, ``reasoning_content``...)
    reach the chat template unchanged."""

    role: Text
    content: Text | list[ContentPart] | None = Field(
        None, description="required, except in an assistant message (which may carry tool_calls instead)")
    name: Text | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_INT)  # --max-logprobs caps it (client.check_params)
    tools: list[JsonObject] | None = None
    tool_choice: Text | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: JsonObject | None = None
    documents: list[JsonObject] | None = Field(None, description="passed to the chat template")
    reasoning_effort: Text | None = Field(None, description="passed to the chat template, as vLLM does")
    include_reasoning: bool = Field(True, description="false: no reasoning_content (--reasoning-parser)")
    # see SamplingFields' list (fd_server.refused)
    functions: Json = None
    function_call: Json = None
    audio: Json = None
    modalities: Json = None
    web_search_options: Json = None
    verbosity: Json = None
    continue_final_message: bool = Field(False, description="the model goes on with the last message (vLLM's); "
                                                           "needs add_generation_prompt false")
    echo: bool = Field(False, description="the reply begins with the last message's text where that is the "
                                          "assistant's (vLLM's)")
    chat_template: Json = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _drop_unused(self, handler: Any) -> dict[str, Any]:
        # as OpenAI: no tool_calls key in a message without calls (nor reasoning without a parser)
        out = handler(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        if out.get("reasoning_content") is None:
            out.pop("reasoning_content", None)
        return out


class ChatCompletionChoice(_IfAsked):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(_IfAsked):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's place for the chat endpoint's
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only the keys that changed
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_IfAsked):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's


class ChatCompletionChunk(_IfAsked):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the first chunk with a token
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


# -- completions -----------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, le=MAX_INT)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_INT)  # as vLLM: --max-logprobs, not OpenAI's 5
    suffix: Text | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    prompt_embeds: Json = None  # refused (fd_server.refused)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_IfAsked):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # streamed: in the choice's first chunk
    # return_token_ids: the prompt's (streamed: in the choice's first chunk) and the output's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- models, version -------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fd"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
