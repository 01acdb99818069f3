"""Structured output through a real ``fd serve`` of the default model (SmolLM2) and the
official ``openai`` client: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*``, streamed and not; every JSON answer validates against its schema. On the cpu
backend and on an emulated vendor backend (xpu); the GPU's run is the cuda backend's
``tests/test_structured_cuda.py``."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from tests.servers import default_model_server  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
     "required": ["colour", "score", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1},
            "email": {"type": "string", "maxLength": 40},
            "roles": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3}},
            "required": ["id", "email", "roles"], "additionalProperties": False},
        "active": {"type": "boolean"}},
     "required": ["user", "active"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 25},
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "forecast": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                             "rain": {"type": "boolean"}},
            "required": ["day", "rain"], "additionalProperties": False}}},
     "required": ["city", "temperature", "forecast"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 1, "maximum": 9},
                                      "why": {"type": "string", "maxLength": 40}},
     "required": ["answer"]},
]
PROMPTS = ["Describe a person.", "Tell me about the weather.", "Give me some data about a user.",
           "Pick a colour and a score.", "Answer with a number from 1 to 9."]


@pytest.fixture(scope="module", params=["cpu", "xpu"])
def server(request, tmp_path_factory):
    """The cpu backend, and a vendor backend emulated on the CPU: the same requests pass on both."""
    with default_model_server(MODEL, request.param, tmp_path_factory.mktemp("log") / "server.log",
                              "--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-num-seqs", "32",
                              emulated=request.param != "cpu") as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return server.openai().with_options(timeout=300)


def ask(oai, i: int, stream: bool) -> tuple[dict, str, str]:
    schema = SCHEMAS[i % len(SCHEMAS)]
    messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)] + " Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": f"s{i % len(SCHEMAS)}", "schema": schema, "strict": True}}
    kw = {"model": MODEL, "messages": messages, "response_format": fmt, "max_tokens": 300, "temperature": 0.8,
          "seed": i}
    if not stream:
        r = oai.chat.completions.create(**kw)
        return schema, r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return schema, "".join(text), finish


def test_fifty_json_schema_requests_validate(server, oai):
    count = 50 if server.device == "cpu" else 6  # the emulated backend runs unfused reference ops
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: ask(oai, i, stream=i % 2 == 1), range(count)))
    for schema, text, finish in results:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), schema)


def test_parse_with_a_pydantic_model(oai):
    class Person(pydantic.BaseModel):
        name: str
        age: int

    completion = oai.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
        max_tokens=200, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and person.name


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_regex_and_choice(oai, field):
    def body(kind, value):
        return {"structured_outputs": {kind: value}} if field == "structured_outputs" else {f"guided_{kind}": value}

    msg = [{"role": "user", "content": "What is your phone number?"}]
    r = oai.chat.completions.create(model=MODEL, messages=msg, max_tokens=30, temperature=1.0, seed=3,
                                    extra_body=body("regex", r"\(\d{3}\) \d{3}-\d{4}"))
    assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r.choices[0].message.content)
    r = oai.completions.create(model=MODEL, prompt="Three small numbers:", max_tokens=30, temperature=1.0, seed=2,
                               extra_body=body("json", {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 3,
                                                        "maxItems": 3}))
    assert len(json.loads(r.choices[0].text)) == 3
    choices = ["positive", "negative", "neutral"]
    r = oai.completions.create(model=MODEL, prompt="The film was great. Sentiment:", max_tokens=10, n=3,
                               temperature=1.0, seed=1, extra_body=body("choice", choices))
    assert all(c.text in choices and c.finish_reason == "stop" for c in r.choices)


def door_only(server) -> None:
    """Checked in the HTTP process before any backend is involved: once (on cpu) is enough."""
    if server.device != "cpu":
        pytest.skip("decided in the HTTP process, whatever the backend")


def test_grammar_and_json_object_streamed(oai):
    msg = [{"role": "user", "content": "Say yes or no."}]
    text = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model=MODEL, messages=msg, max_tokens=20, stream=True,
        extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}}) if c.choices)
    assert text in ("yes!", "no!")
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object please."}],
                                    response_format={"type": "json_object"}, max_tokens=60, temperature=0,
                                    extra_body={"structured_outputs": None})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"grammar": "root ::= (("}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    import httpx

    door_only(server)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" or error["type"] == "BadRequestError", error


def test_unknown_structured_outputs_key_is_400(server):
    import httpx

    door_only(server)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 5, "structured_outputs": {"structural_tag": "x"}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "structural_tag" in r.text, r.text
