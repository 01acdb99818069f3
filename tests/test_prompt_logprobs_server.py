"""``prompt_logprobs`` and completions' ``echo`` with ``logprobs`` through a real ``fd serve`` of
the default model (SmolLM2), with the official ``openai`` client and plain HTTP: streamed and
not, a text prompt and a token-id prompt, and the 400s naming the field. The numbers themselves
are checked against transformers in ``test_prompt_logprobs.py``; here, that a repeated sentence
is far more likely the second time says they are the model's."""

from __future__ import annotations

import itertools
import json

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from fd_core.loader import resolve_model  # noqa: E402
from tests.servers import Server  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SENTENCE = "The quick brown fox jumps over the lazy dog."
PROMPT = f"Prompt logprobs check. {SENTENCE} {SENTENCE}"  # ASCII: each token decodes to its own text
GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        resolve_model(MODEL)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the default model is not installed: {exc}")
    # a budget of 16 tokens a step: the prompt is prefilled in chunks
    srv = Server(MODEL, tmp_path_factory.mktemp("log") / "server.log", "--max-model-len", "1024",
                 "--num-kv-blocks", "256", "--max-num-batched-tokens", "16", "--long-prefill-token-threshold", "8")
    with srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return server.openai().with_options(timeout=300)


@pytest.fixture(scope="module")
def tokenizer(server):
    from fd_core.loader.formats import load_tokenizer

    return load_tokenizer(resolve_model(MODEL))


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=300)


def sse(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_echo_with_logprobs_starts_with_the_prompt(oai):
    plain = oai.completions.create(prompt=PROMPT, logprobs=2, **GREEDY)
    echoed = oai.completions.create(prompt=PROMPT, logprobs=2, echo=True, **GREEDY)
    (choice,) = echoed.choices
    n = echoed.usage.prompt_tokens
    lp = choice.logprobs
    assert choice.text == PROMPT + plain.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 3
    assert "".join(lp.tokens[:n]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) in (2, 3) and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs) if i)
    # offsets run on from the prompt's into the completion's
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    # the completion's part is what the request without echo gets
    assert lp.tokens[n:] == plain.choices[0].logprobs.tokens
    np.testing.assert_allclose(lp.token_logprobs[n:], plain.choices[0].logprobs.token_logprobs, atol=1e-4)
    # the second time the sentence comes, the model all but knows it: these are its numbers
    words = len(lp.tokens[1:n]) // 2
    first, second = lp.token_logprobs[1 : 1 + words], lp.token_logprobs[n - words + 1 : n]
    assert np.mean(second) > -1.0 > np.mean(first), (np.mean(first), np.mean(second))


def test_echo_streamed_is_the_plain_answer(oai):
    plain = oai.completions.create(prompt=PROMPT, logprobs=1, echo=True, **GREEDY).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(prompt=PROMPT, logprobs=1, echo=True, stream=True,
                                                           **GREEDY)]
    assert chunks[0].text == PROMPT  # the prompt's part first, with its logprobs
    assert chunks[0].logprobs.token_logprobs[0] is None
    assert "".join(c.text for c in chunks) == plain.text
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    values = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == plain.logprobs.tokens and offsets == plain.logprobs.text_offset
    assert values[0] is None
    np.testing.assert_allclose(values[1:], plain.logprobs.token_logprobs[1:], atol=1e-4)


def test_echo_of_a_token_id_prompt(oai, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    by_text = oai.completions.create(prompt=PROMPT, logprobs=0, echo=True, **GREEDY).choices[0]
    by_ids = oai.completions.create(prompt=ids, logprobs=0, echo=True, **GREEDY).choices[0]
    assert by_ids.text == by_text.text and by_ids.logprobs.tokens == by_text.logprobs.tokens
    assert len(by_ids.logprobs.tokens) == len(ids) + 3 and by_ids.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(by_ids.logprobs.token_logprobs[1:], by_text.logprobs.token_logprobs[1:], atol=1e-4)


def check_entries(scores: list, ids: list[int], k: int, tokenizer) -> None:
    """vLLM's shape: null, then per prompt token {id: {logprob, rank, decoded_token}}, holding
    that token and the top k."""
    assert scores[0] is None and len(scores) == len(ids)
    for token, entry in zip(ids[1:], scores[1:]):
        assert str(token) in entry and len(entry) in (k, k + 1)
        for token_id, lp in entry.items():
            assert set(lp) == {"logprob", "rank", "decoded_token"}
            assert lp["logprob"] <= 0 and lp["rank"] >= 1
            assert lp["decoded_token"] == tokenizer.decode([int(token_id)], skip_special_tokens=False)
        ranked = sorted(entry.values(), key=lambda lp: -lp["logprob"])
        assert ranked[0]["rank"] == 1 and all(a["logprob"] >= b["logprob"] for a, b in itertools.pairwise(ranked))


def test_completions_prompt_logprobs_streamed_and_not(server, tokenizer):
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    r = post(server, "/v1/completions", prompt=PROMPT, temperature=0, max_tokens=3, prompt_logprobs=3, n=2)
    assert r.status_code == 200, r.text
    body = r.json()
    scores = body["choices"][0]["prompt_logprobs"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    check_entries(scores, ids, 3, tokenizer)
    assert body["choices"][1]["prompt_logprobs"] == scores  # each choice, as vLLM
    # the echoed prompt's logprobs are the prompt logprobs of its tokens
    echoed = post(server, "/v1/completions", prompt=PROMPT, temperature=0, max_tokens=3, echo=True,
                  logprobs=3).json()["choices"][0]["logprobs"]
    n = len(ids)
    np.testing.assert_allclose(echoed["token_logprobs"][1:n],
                               [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], scores[1:])], atol=1e-4)
    chunks = sse(httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 3, "prompt_logprobs": 3, "stream": True},
        timeout=300))
    first, *rest = [c["choices"][0] for c in chunks]
    assert all("prompt_logprobs" not in c for c in rest)
    assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) == n
    for a, b in zip(first["prompt_logprobs"][1:], scores[1:]):
        assert a.keys() == b.keys()
        np.testing.assert_allclose([v["logprob"] for v in a.values()], [v["logprob"] for v in b.values()], atol=1e-4)
    assert "".join(c["text"] for c in [first, *rest]) == body["choices"][0]["text"]


def test_chat_prompt_logprobs_streamed_and_not(server, tokenizer):
    messages = [{"role": "user", "content": "Say hi."}]
    r = post(server, "/v1/chat/completions", messages=messages, temperature=0, max_tokens=3, prompt_logprobs=1)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                           add_special_tokens=False)
    check_entries(body["prompt_logprobs"], ids, 1, tokenizer)  # beside the choices, as vLLM
    chunks = sse(httpx.post(server.url + "/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 3, "prompt_logprobs": 1,
        "stream": True}, timeout=300))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [entry and sorted(entry) for entry in chunks[0]["prompt_logprobs"]] == \
        [entry and sorted(entry) for entry in body["prompt_logprobs"]]
    assert all("prompt_logprobs" not in c for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path, extra", [("/v1/completions", {"prompt": "Hi"}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
@pytest.mark.parametrize("body, param, message", [
    ({"prompt_logprobs": 21}, "prompt_logprobs", "at most 20 (--max-logprobs)"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "every token of the vocabulary"),
    ({"prompt_logprobs": "all"}, "prompt_logprobs", None),
])
def test_bad_prompt_logprobs_are_400_naming_the_field(server, path, extra, body, param, message):
    r = post(server, path, **extra, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if message is not None:
        assert message in error["message"]


def test_echo_with_too_many_logprobs_names_logprobs(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(prompt="Hi", echo=True, logprobs=21, **GREEDY)
    assert info.value.body["param"] == "logprobs"
