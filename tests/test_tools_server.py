"""Tool calling and reasoning through a real ``fd serve`` of SmolLM2 and the ``openai`` client:
``tool_choice`` required and named (enforced with structured output, so even this small model's
calls validate against their tools' parameters), auto with a parser, streamed deltas that
reassemble to the non-streamed message, reasoning split off with a parser, and the 400s; on the
cpu backend and on a vendor backend emulated on the CPU."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from fd_core.bench.datasets import load_tokenizer  # noqa: E402
from tests.servers import default_model_server  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}},
                       "required": ["tz"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


@pytest.fixture(scope="module", params=["cpu", "xpu"])
def server(request, tmp_path_factory):
    with default_model_server(MODEL, request.param, tmp_path_factory.mktemp("log") / "server.log",
                              "--max-model-len", "2048", "--num-kv-blocks", "512", "--tool-call-parser", "hermes",
                              "--enable-auto-tool-choice", emulated=request.param != "cpu") as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return server.openai().with_options(timeout=300)


def check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def streamed(oai, **kw):
    """The calls (by index: name, arguments), content and finish reason a stream reassembles to."""
    calls, content, finish = {}, "", None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    entry["id"], entry["name"] = d.id, d.function.name
                entry["arguments"] += d.function.arguments or ""
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)], content, finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_required_and_named_calls_validate_and_stream_the_same(oai, choice):
    kw = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 200,
          "temperature": 0}
    r = oai.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not message.content
    check_calls(message.tool_calls)
    if isinstance(choice, dict):
        assert [c.function.name for c in message.tool_calls] == ["get_time"]
    calls, content, finish = streamed(oai, **kw)
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert finish == "tool_calls" and not content


def test_parallel_tool_calls_false_gives_one_call(oai):
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                    parallel_tool_calls=False, max_tokens=200, temperature=0.7, seed=3)
    check_calls(r.choices[0].message.tool_calls)
    assert len(r.choices[0].message.tool_calls) == 1


def test_auto_answers_as_text_or_calls(oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS,
                                    max_tokens=30, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_tool_results_reach_the_template(oai):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "JST"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "09:00"}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=10)
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
])
def test_bad_tools_are_400_naming_the_field(server, extra, param):
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": ASK, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module", params=["cpu", "xpu"])
def thinking_server(request, tmp_path_factory):
    """A server with a reasoning parser and no tool parser."""
    with default_model_server(MODEL, request.param, tmp_path_factory.mktemp("log") / "server.log",
                              "--max-model-len", "2048", "--num-kv-blocks", "256", "--reasoning-parser",
                              "deepseek_r1", emulated=request.param != "cpu") as srv:
        yield srv


def test_reasoning_is_split_whole_and_streamed(thinking_server):
    """SmolLM2 does not think; a grammar makes it write a thought, ``</think>``, then an answer."""
    oai = thinking_server.openai().with_options(timeout=300)
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Greet me."}], "max_tokens": 60,
          "temperature": 0, "extra_body": {"structured_outputs": {"regex": r"[a-z ]{3,30}</think>[A-Za-z ]{2,20}"}}}
    message = oai.chat.completions.create(**kw).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and message.content and "</think>" not in message.content
    r, c = "", ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            r += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            c += choice.delta.content or ""
    assert (r, c) == (reasoning, message.content)
    # include_reasoning false: the thought is split off and dropped, whole and streamed
    kw["extra_body"]["include_reasoning"] = False
    message = oai.chat.completions.create(**kw).choices[0].message
    assert "reasoning_content" not in (message.model_extra or {}) and message.content == c
    chunks = [choice.delta for chunk in oai.chat.completions.create(stream=True, **kw) for choice in chunk.choices]
    assert not any((d.model_extra or {}).get("reasoning_content") for d in chunks)
    assert "".join(d.content or "" for d in chunks) == c


def test_token_rules_hold(thinking_server):
    """allowed_token_ids and bad_words through the server, on each backend."""
    oai = thinking_server.openai().with_options(timeout=300)
    ask = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    assert "Paris" in oai.completions.create(**ask).choices[0].text
    banned = oai.completions.create(**ask, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned and banned
    tokenizer = load_tokenizer(MODEL)
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    r = oai.completions.create(model=MODEL, prompt="Is it?", max_tokens=6, temperature=0,
                               extra_body={"allowed_token_ids": allowed})
    assert r.choices[0].text and set(r.choices[0].text.split()) <= {"yes", "no"}


def test_auto_tool_choice_needs_the_flags(thinking_server):
    import httpx

    r = httpx.post(thinking_server.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_unknown_parser_stops_start_up(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "fd_server", "--model", MODEL, "--tool-call-parser", "mistral"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--tool-call-parser mistral: no such parser" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
