"""SamplingParams: what a request asks of the sampler, validated when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fd_core.engine.structured.params import StructuredOutputsParams
from fd_core.errors import InvalidRequestError, check_text

_GREEDY_BELOW = 1e-5

# Upper bounds of the integer fields. Every front end parses requests against these (the HTTP
# schema imports them), and a SamplingParams past one cannot be built: the engine packs these
# values into int64 arrays and msgpack carries at most 64 bits, so an unbounded integer would
# fail inside a step instead of at the door.
MAX_N = 128  # choices per request: enough for any sampling recipe, bounded so one call cannot flood the engine
MAX_LOGPROBS = 20  # the default --max-logprobs, as vLLM's
MAX_SEED = 2**63 - 1  # int64, vLLM's bound too
MAX_INT = 2**31 - 1  # top_k, max_tokens, min_tokens, token ids: far past any vocabulary or context
MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 1024  # per stop string: each is searched in every new piece of text
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 256  # each is compared with the output's tail at every step
MAX_ALLOWED_TOKEN_IDS = 2**20  # past any vocabulary
MAX_LOGIT_BIAS = 1024  # biased tokens per request, as many as stop_token_ids: each is scattered every step
MAX_BIAS = 100.0  # OpenAI's range for a bias, [-100, 100]: -100 bans a token, +100 all but forces it


@dataclass
class SamplingParams:
    """Per-request generation settings, with vLLM's names and defaults.

    ``temperature=0`` is greedy. ``seed`` makes sampling repeatable whatever else runs in the
    same batch. ``stop`` strings are not included in the output text; ``stop_token_ids`` and
    the model's end-of-sequence tokens end generation too (unless ``ignore_eos``).
    ``logprobs=k`` returns the sampled token's log-probability and the top ``k`` per step;
    ``prompt_logprobs=k`` the same for every prompt token after the first (given the tokens
    before it), in ``RequestOutput.prompt_logprobs``.
    ``structured_outputs`` constrains the output to a JSON schema, regex, choice or grammar.
    ``allowed_token_ids``: only these tokens may be sampled (end-of-sequence included: a list
    without it runs to ``max_tokens``). ``bad_words``: never produced, as vLLM defines it: each
    word is tokenized as written and after a space, and the last token of either spelling is
    banned wherever the output so far ends with the tokens before it.
    ``logit_bias`` maps token ids (ints, or decimal strings as JSON keys are) to a bias in
    [-100, 100] added to that token's logit before the penalties, as OpenAI and vLLM do.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # logit_bias as SamplingBatch takes it, made once rather than at every step
    bias_arrays: tuple[np.ndarray, np.ndarray] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # its wire form
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams",
                                      param="structured_outputs")
        self._validate()
        if self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
            ids = np.fromiter(self.logit_bias, dtype=np.int64, count=len(self.logit_bias))
            values = np.fromiter(self.logit_bias.values(), dtype=np.float32, count=len(self.logit_bias))
            self.bias_arrays = (ids, values)
        if self.top_k == -1:
            self.top_k = 0
        if 0 < self.temperature < _GREEDY_BELOW:
            self.temperature = 0.0  # as vLLM: dividing by a near-zero temperature overflows

    def _validate(self) -> None:
        def bad(msg: str, param: str | None = None) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise bad(f"{name} must be a number, got {value!r}")
            return float(value)

        def integer(name: str, value: object, low: int = 0, high: int = MAX_INT, param: str | None = None) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise bad(f"{name} must be an integer, got {value!r}", param)
            if not low <= value <= high:
                raise bad(f"{name} must be an integer in [{low}, {high}], got {value}", param)
            return value

        def token_ids(name: str, ids: object, most: int, may_be_empty: bool) -> None:
            if ids is None:
                return
            if not isinstance(ids, (list, tuple)) or not (ids or may_be_empty) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in ids):
                kind = "a list" if may_be_empty else "a non-empty list"
                raise InvalidRequestError(f"{name} must be {kind} of integers in [0, {MAX_INT}]", param=name)
            if len(ids) > most:
                raise InvalidRequestError(f"{name} takes at most {most} ids, got {len(ids)}", param=name)

        integer("n", self.n, 1, MAX_N)
        if number("temperature", self.temperature) < 0 or math.isinf(self.temperature):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < number("top_p", self.top_p) <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        integer("top_k", self.top_k, -1)  # -1 and 0 disable it; past the vocabulary it keeps every token
        if not 0 <= number("min_p", self.min_p) <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= number("presence_penalty", self.presence_penalty) <= 2:
            raise bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= number("frequency_penalty", self.frequency_penalty) <= 2:
            raise bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        rp = number("repetition_penalty", self.repetition_penalty)
        if not 0 < rp or math.isinf(rp):
            raise bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            integer("seed", self.seed, 0, MAX_SEED)
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1)
        integer("min_tokens", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0)  # the engine's --max-logprobs caps it (core.check_params)
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs == -1:  # vLLM's "the whole vocabulary"
                raise InvalidRequestError(
                    "prompt_logprobs=-1 (every token of the vocabulary) is not supported: ask for at most "
                    "--max-logprobs (20 by default)", param="prompt_logprobs")
            integer("prompt_logprobs", self.prompt_logprobs, 0, param="prompt_logprobs")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
                raise bad("stop must be a non-empty string or a list of non-empty strings")
            if len(stops) > MAX_STOP:
                raise bad(f"stop takes at most {MAX_STOP} strings, got {len(stops)}")
            for s in stops:
                if len(s) > MAX_STOP_CHARS:
                    raise bad(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {len(s)}")
                check_text("stop", s)
        token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS, may_be_empty=True)
        token_ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS, may_be_empty=False)
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise InvalidRequestError("bad_words must be a list of strings with something besides spaces",
                                          param="bad_words")
            if len(words) > MAX_BAD_WORDS:
                raise InvalidRequestError(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(words)}",
                                          param="bad_words")
            for w in words:
                if len(w) > MAX_STOP_CHARS:
                    raise InvalidRequestError(f"a bad word may have at most {MAX_STOP_CHARS} characters, got {len(w)}",
                                              param="bad_words")
                check_text("bad_words", w)

    @property
    def biased(self) -> bool:
        """Whether sampling adds a bias to some token's logit (an empty map asks for nothing)."""
        return bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether sampling reads the tokens so far (presence, frequency, repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _logit_bias(value: object) -> dict[int, float]:
    """``logit_bias`` checked, with int keys and float values; an error names the field."""
    def bad(msg: str) -> InvalidRequestError:
        return InvalidRequestError(f"logit_bias {msg}", param="logit_bias")

    if not isinstance(value, dict):
        raise bad(f"must map token ids to biases, got {type(value).__name__}")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad(f"takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    out = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or not 0 <= token <= MAX_INT:
            raise bad(f"keys must be token ids, integers in [0, {MAX_INT}], got {key!r}")
        if (isinstance(bias, bool) or not isinstance(bias, (int, float, np.integer, np.floating))
                or not -MAX_BIAS <= bias <= MAX_BIAS):
            raise bad(f"values must be numbers in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias!r} for token {key!r}")
        if int(token) in out:
            raise bad(f"names token {int(token)} twice")
        out[int(token)] = float(bias)
    return out
