"""``--speculative-config``: which proposer, how many tokens it proposes a step, and its knobs.

The keys are vLLM's (``method``, ``num_speculative_tokens``, ``model``, ``prompt_lookup_min``,
``prompt_lookup_max``); FastDeploy's flag takes the same JSON object. Every mistake is a
start-up error that names the flag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from fd_core.errors import ConfigError
from fd_core.interfaces.capabilities import SPECULATIVE_METHODS as METHODS

MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5
FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft_model: the draft's checkpoint; mtp: where the MTP weights are, if apart
    # ngram: the shortest and the longest suffix of the sequence looked up in it, longest first;
    # as in vLLM, 5 and 5 when neither is given, and one given alone stands for both
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """The flag's JSON text (or the same as a dict, for ``LLM(speculative_config=...)``),
        checked; None where speculation is off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{FLAG} is not valid JSON: {e.msg} (at character {e.pos})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{FLAG} must be a JSON object such as "
                              f'{{"method": "ngram", "num_speculative_tokens": 4}}, got {value!r}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"{FLAG}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                              f"{', '.join(sorted(known))}")
        args = dict(value)
        if args.get("method") is None and args.get("model") is not None:
            args["method"] = "draft_model"  # vLLM: a model without a method is a draft model
        for key in ("method", "num_speculative_tokens"):
            if args.get(key) is None:
                raise ConfigError(f"{FLAG} needs {key!r}")
        if args["method"] == "ngram":
            low, high = args.get("prompt_lookup_min"), args.get("prompt_lookup_max")
            args["prompt_lookup_min"] = low if low is not None else high if high is not None else DEFAULT_LOOKUP
            args["prompt_lookup_max"] = high if high is not None else args["prompt_lookup_min"]
        config = cls(**args)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"{FLAG}: method {self.method!r} is not one of {', '.join(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"{FLAG}: num_speculative_tokens must be an integer from 1 to "
                              f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.method == "draft_model" and not self.model:
            raise ConfigError(f"{FLAG}: method 'draft_model' needs 'model', the draft's checkpoint")
        if self.method == "ngram":
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (low, high)) or low > high:
                raise ConfigError(f"{FLAG}: prompt_lookup_min and prompt_lookup_max must be integers with "
                                  f"1 <= prompt_lookup_min <= prompt_lookup_max, got {low!r} and {high!r}")

    def check_against(self, backend: str, methods: frozenset[str]) -> None:
        """A method the backend does not declare (``Capabilities.speculative_methods``) is refused."""
        if self.method not in methods:
            have = ", ".join(sorted(methods)) if methods else "none"
            raise ConfigError(f"{FLAG}: method {self.method!r} is not available on the {backend} backend "
                              f"(it declares: {have})")
