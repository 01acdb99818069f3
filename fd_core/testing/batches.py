"""Sampling batches for tests: every field at its "off" value unless given."""

from __future__ import annotations

from typing import Any

import numpy as np

from fd_core.interfaces.ops import SamplingBatch


def make_sampling_batch(num_rows: int, **fields: Any) -> SamplingBatch:
    """A ``SamplingBatch`` of ``num_rows`` rows: temperature 1, no top-k/top-p/min-p, no
    penalties, seeds ``0..num_rows-1``, step 0, no token lists, no logprobs, no logit bias. A
    keyword of a field's name gives that field, one value per row (``num_logprobs``: one number;
    ``logit_bias``: an ``(ids, biases)`` pair per row)."""

    def column(name: str, value: Any, dtype: Any) -> np.ndarray:
        return np.asarray(fields.get(name, [value] * num_rows), dtype=dtype)

    def ids(name: str) -> list[np.ndarray]:
        return [np.asarray(t, np.int64) for t in fields.get(name, [[]] * num_rows)]

    return SamplingBatch(
        temperature=column("temperature", 1.0, np.float32),
        top_p=column("top_p", 1.0, np.float32),
        top_k=column("top_k", 0, np.int64),
        min_p=column("min_p", 0.0, np.float32),
        presence_penalty=column("presence_penalty", 0.0, np.float32),
        frequency_penalty=column("frequency_penalty", 0.0, np.float32),
        repetition_penalty=column("repetition_penalty", 1.0, np.float32),
        seeds=np.asarray(fields.get("seeds", np.arange(num_rows)), dtype=np.int64),
        steps=column("steps", 0, np.int64),
        prompt_token_ids=ids("prompt_token_ids"),
        output_token_ids=ids("output_token_ids"),
        suppress_token_ids=ids("suppress_token_ids"),
        num_logprobs=fields.get("num_logprobs", 0),
        logit_bias=None if fields.get("logit_bias") is None else [
            (np.asarray(ids, np.int64), np.asarray(biases, np.float32)) for ids, biases in fields["logit_bias"]],
    )
