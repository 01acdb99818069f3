"""Requests an attacker or a careless client sends, against a real ``fd serve`` (issue 14).

Each test is one of the reproducible failures found by hand: a request that killed the engine,
an 800-byte request that held it for a minute, a huge prompt or body that stalled the HTTP
process, a lone surrogate answered with a 500, a frozen engine still called healthy, a message
without content failing inside the template, flags checked late. Then a property-based fuzz
with request bodies biased to the edges: no 5xx, and the server healthy after every example.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")  # the tiny checkpoint is written with transformers

if not sys.platform.startswith("linux"):
    pytest.skip("finding the engine-core process reads /proc", allow_module_level=True)

from tests import checkpoints  # noqa: E402
from tests.servers import API_KEY, Server  # noqa: E402

NAME = "tiny-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_SEQUENCES = 64  # --max-sequences-per-request of the module's server


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(checkpoints.make_llama(tmp_path_factory.mktemp("hardening")))


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    srv = Server(tiny_model, tmp_path_factory.mktemp("log") / "server.log", "--served-model-name", NAME,
                 "--api-key", API_KEY, "--num-kv-blocks", "512", "--max-num-seqs", "16",
                 "--max-sequences-per-request", str(MAX_SEQUENCES))
    with srv:
        yield srv


def post(server: Server, path: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={**AUTH, "Content-Type": "application/json"})


def assert_serving(server: Server) -> None:
    """Healthy, and a plain request still gets its tokens."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200, server.log()
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "ok", "max_tokens": 3, "temperature": 0,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- 1. integers without a bound ------------------------------------------------------------------

BIG = [2**31, 2**63 - 1, 2**63, 2**64, 10**30]


@pytest.mark.parametrize("field, values", [
    ("top_k", BIG),
    ("seed", [2**63, 2**64, 10**30, -1]),
    ("n", [129, 2**63, 2**64]),
    ("min_tokens", BIG),
    ("max_tokens", BIG),
    ("logprobs", [21, 2**63, 2**64]),
    ("best_of", [2**64]),
    ("stop_token_ids", [[2**63], [2**64], [-1], list(range(2000))]),
    ("prompt", [[2**63], [2**64], [[1, 2**64]], [-5]]),
])
def test_out_of_range_integers_are_400_naming_the_field(server, field, values):
    for value in values:
        body = {"model": NAME, "prompt": "hi", "max_tokens": 2, field: value}
        error = error_of(post(server, "/v1/completions", body), 400)
        assert error["param"] is not None and error["param"].split(".")[0] == field, (value, error)
    assert_serving(server)


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("top_k", 2**64), ("seed", 2**64), ("top_logprobs", 2**64), ("max_completion_tokens", 2**64),
    ("n", 10**20),
])
def test_out_of_range_integers_in_chat_are_400(server, field, value):
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            field: value}
    assert error_of(post(server, "/v1/chat/completions", body), 400)["param"] == field
    assert_serving(server)


def test_a_huge_top_k_keeps_every_token(server):
    """Within the bound, a top_k past the vocabulary means no top-k (it used to overflow int64)."""
    base = {"model": NAME, "prompt": "The weather", "max_tokens": 6, "seed": 5, "ignore_eos": True}
    wide = post(server, "/v1/completions", {**base, "top_k": 2**31 - 1})
    off = post(server, "/v1/completions", {**base, "top_k": 0})
    assert wide.status_code == off.status_code == 200
    assert wide.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]


# -- 2. amplification -------------------------------------------------------------------------------


def test_prompts_times_n_is_capped(server):
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [[1, 2, 3]] * 64, "n": 128, "max_tokens": 1})
    error = error_of(r, 400)
    assert "8192" in error["message"] and str(MAX_SEQUENCES) in error["message"]
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}],
                                              "n": MAX_SEQUENCES + 1, "max_tokens": 1})
    assert error_of(r, 400)["param"] == "n"
    # at the cap it runs: every choice comes back
    r = post(server, "/v1/completions", {"model": NAME, "prompt": [[1, 2, 3]] * 4, "n": MAX_SEQUENCES // 4,
                                         "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == MAX_SEQUENCES


def test_an_abandoned_amplified_request_stops_at_once(server):
    """The client of the largest request the server takes goes away: the engine drops it all."""
    body = {"model": NAME, "prompt": [[1, 2, 3]] * 4, "n": MAX_SEQUENCES // 4, "max_tokens": 200,
            "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", body, timeout=1.0)
    deadline = time.monotonic() + 15
    while True:
        m = server.metrics()
        if m["fd:num_requests_running"] == 0 and m["fd:num_requests_waiting"] == 0 \
                and m["fd:kv_cache_free_blocks"] == m["fd:kv_cache_total_blocks"]:
            break
        assert time.monotonic() < deadline, f"still working on an abandoned request: {m}"
        time.sleep(0.1)
    assert_serving(server)


# -- 3. tokenization off the event loop ---------------------------------------------------------------


def _health_latencies(server: Server, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            started = time.monotonic()
            assert http.get(server.url + "/health").status_code == 200
            out.append(time.monotonic() - started)
            time.sleep(0.02)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_10mb_prompt_is_refused_quickly_and_health_stays_up(server, endpoint):
    text = "lorem ipsum dolor sit amet " * 400_000  # 10.8 MB, inside the 32 MiB body limit
    body = ({"model": NAME, "prompt": text} if endpoint == "/v1/completions"
            else {"model": NAME, "messages": [{"role": "user", "content": text}]})
    stop, latencies = threading.Event(), []
    poller = threading.Thread(target=_health_latencies, args=(server, stop, latencies))
    poller.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        r = post(server, endpoint, body)
        took = time.monotonic() - started
        time.sleep(0.2)
    finally:
        stop.set()
        poller.join()
    assert error_of(r, 400)["code"] == "context_length_exceeded"
    # bounds far above what it takes (well under a second each), far below tokenizing 10 MB
    assert took < 5.0, took
    assert latencies and max(latencies) < 2.0, max(latencies)


# -- 4. the body limit while the body streams in ------------------------------------------------------


def _rss_peak_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))


def _chunked_upload(server: Server, path: str, total: int, chunk: int = 1 << 20) -> tuple[int, int]:
    """Send a chunked body of ``total`` bytes (no Content-Length) as fast as the server takes it;
    return (HTTP status, bytes sent before the server answered or closed)."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sent = 0
    try:
        sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
                      "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode())
        payload = f"{chunk:x}\r\n".encode() + b"x" * chunk + b"\r\n"
        try:
            while sent < total:
                sock.sendall(payload)
                sent += chunk
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read what it said
        sock.settimeout(30)
        reply = b""
        while b"\r\n" not in reply:
            data = sock.recv(65536)
            if not data:
                break
            reply += data
        return int(reply.split(b" ", 2)[1]), sent
    finally:
        sock.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/nowhere"])
def test_a_chunked_body_over_the_limit_is_refused_while_it_streams_in(server, path):
    before = _rss_peak_kb(server.proc.pid)
    status, sent = _chunked_upload(server, path, total=400 << 20)
    assert status == 413
    assert sent < 300 << 20  # refused long before the end
    grew_mb = (_rss_peak_kb(server.proc.pid) - before) / 1024
    assert grew_mb < 200, f"the HTTP process grew by {grew_mb:.0f} MB"
    assert_serving(server)


# -- 5. Unicode ---------------------------------------------------------------------------------------

SURROGATE = "\\ud800"  # as JSON writes it: Python reads it as a lone surrogate


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi {SURROGATE}"}}', "prompt"),
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": ["ok", "{SURROGATE}"]}}', "prompt.1"),
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi {SURROGATE}", "echo": true}}', "prompt"),
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi", "stop": "{SURROGATE}"}}', "stop"),
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi", "stop": ["a", "{SURROGATE}"]}}', "stop.1"),
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi", "user": "{SURROGATE}"}}', "user"),
    ("/v1/completions", f'{{"model": "{NAME}{SURROGATE}", "prompt": "hi"}}', "model"),
    ("/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "x{SURROGATE}"}}]}}', "messages.0.content"),
    ("/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": [{{"type": "text", "text": "{SURROGATE}"}}]}}]}}',
     "messages.0.content.0.text"),
    ("/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "x", "extra": ["{SURROGATE}"]}}]}}',
     "messages.0"),
    ("/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "x"}}], "stop": "{SURROGATE}"}}', "stop"),
    ("/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "x"}}], '
     f'"chat_template_kwargs": {{"k": "{SURROGATE}"}}}}', "chat_template_kwargs.k"),
    # in a key (found by the fuzz test: a 500 from the grammar compiler)
    ("/v1/completions", f'{{"model": "{NAME}", "prompt": "hi", "guided_json": {{"{SURROGATE}": null}}}}', "guided_json"),
    ("/v1/chat/completions",
     f'{{"model": "{NAME}", "messages": [{{"role": "user", "content": "x"}}], '
     f'"tools": [{{"type": "function", "function": {{"name": "f"}}, "{SURROGATE}": 1}}]}}', "tools.0"),
])
def test_lone_surrogates_are_400_naming_the_field(server, path, body, param):
    error = error_of(post(server, path, body.encode()), 400)
    assert error["param"] == param, error
    assert "surrogate" in error["message"]
    assert "Traceback" not in server.log()


def test_odd_but_valid_unicode_is_served(server):
    text = "\u202eevil\u202c \u0000 nul e\u0301 \U0001F600 \ufeff\uffff"
    r = post(server, "/v1/completions", {"model": NAME, "prompt": text, "max_tokens": 2, "stop": ["\U0001F600"]})
    assert r.status_code == 200, r.text


# -- 6. health means serving; requests have a bound --------------------------------------------------


def test_a_frozen_engine_is_unhealthy_and_requests_time_out(tiny_model, tmp_path):
    srv = Server(tiny_model, tmp_path / "frozen.log", "--heartbeat-timeout", "1", "--request-timeout", "5",
                 "--num-kv-blocks", "256")
    with srv:
        core = srv.engine_core_pid()
        outcome: dict[str, object] = {}

        async def plain(client) -> None:
            try:
                await client.completions.create(model=tiny_model, prompt="long", max_tokens=250,
                                                extra_body={"ignore_eos": True})
                outcome["plain"] = "finished"
            except openai.APIStatusError as exc:
                outcome["plain"] = (exc.status_code, exc.body["code"])

        async def streamed(client, started: asyncio.Event) -> None:
            stream = await client.completions.create(model=tiny_model, prompt="long", max_tokens=250,
                                                     stream=True, extra_body={"ignore_eos": True})
            try:
                async for _ in stream:
                    started.set()
                outcome["stream"] = "finished"
            except openai.APIError as exc:
                outcome["stream"] = exc.body["code"]

        async def scenario() -> None:
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            started = asyncio.Event()
            tasks = [asyncio.ensure_future(plain(client)), asyncio.ensure_future(streamed(client, started))]
            await asyncio.wait_for(started.wait(), 30)
            os.kill(core, signal.SIGSTOP)
            try:
                async with httpx.AsyncClient(timeout=10) as http:
                    deadline = time.monotonic() + 10
                    while (health := await http.get(srv.url + "/health")).status_code != 503:
                        assert time.monotonic() < deadline, "/health stayed 200 with the engine frozen"
                        await asyncio.sleep(0.1)
                    assert "not reported" in health.json()["error"]["message"]
                    r = await http.post(srv.url + "/v1/completions", json={"model": tiny_model, "prompt": "x"})
                    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
                    m = srv.metrics()
                    assert m["fd:engine_report_age_seconds"] > 1
                    # the requests in flight end at --request-timeout, whatever the engine does
                    await asyncio.wait_for(asyncio.gather(*tasks), 20)
            finally:
                os.kill(core, signal.SIGCONT)
            async with httpx.AsyncClient(timeout=10) as http:
                deadline = time.monotonic() + 10
                while (await http.get(srv.url + "/health")).status_code != 200:
                    assert time.monotonic() < deadline, "/health did not recover after SIGCONT"
                    await asyncio.sleep(0.1)
            await client.close()

        asyncio.run(scenario())
        assert outcome == {"plain": (504, "request_timeout"), "stream": "request_timeout"}, outcome
        r = httpx.post(srv.url + "/v1/completions", json={"model": tiny_model, "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
        # the aborted requests hold no KV blocks
        m = srv.metrics()
        assert m["fd:kv_cache_free_blocks"] == m["fd:kv_cache_total_blocks"], m


# -- 8. a long prompt does not starve short requests ----------------------------------------------------


def test_a_short_request_behind_a_long_prompt_finishes_first(tmp_path):
    """A tiny budget makes the 4,000-token prefill take hundreds of steps: time enough to send a short
    request behind it. With the cap, the short one is served while the long one is still prefilling;
    without it, it would wait for the whole prefill."""
    model = checkpoints.make_llama(tmp_path / "model", max_position_embeddings=4096)
    srv = Server(str(model), tmp_path / "long.log", "--max-model-len", "4096", "--num-kv-blocks", "512",
                 "--max-num-batched-tokens", "8", "--long-prefill-token-threshold", "4")
    with srv:
        done: dict[str, float] = {}

        def complete(name: str, prompt: list[int]) -> None:
            r = httpx.post(srv.url + "/v1/completions", timeout=300,
                           json={"model": str(model), "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            done[name] = time.monotonic()

        long = threading.Thread(target=complete, args=("long", [(7 * i) % 250 + 3 for i in range(4000)]))
        long.start()
        deadline = time.monotonic() + 30
        while srv.metrics()["fd:num_requests_running"] < 1:
            assert time.monotonic() < deadline and long.is_alive(), srv.log()
            time.sleep(0.01)
        complete("short", [5, 6, 7])
        long.join(300)
        assert done["short"] < done["long"], f"the short request waited for the long prefill: {done}"


# -- 7. the schema and the behaviour agree ---------------------------------------------------------------


def test_a_message_without_content(server):
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user"}]})
    error = error_of(r, 400)
    assert error["param"] == "messages.0.content" and "required" in error["message"]
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": None}]})
    assert error_of(r, 400)["param"] == "messages.0.content"
    # OpenAI's assistant turn that called a tool has content null
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = post(server, "/v1/chat/completions", {"model": NAME, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_the_schema_states_the_bounds_as_integers(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    fields = schema["CompletionRequest"]["properties"]
    seed = next(s for s in fields["seed"]["anyOf"] if s.get("type") == "integer")
    assert seed["maximum"] == 2**63 - 1 and isinstance(seed["maximum"], int)
    top_k = fields["top_k"]
    assert top_k["maximum"] == 2**31 - 1 and top_k["minimum"] == -1
    assert "required" in schema["ChatMessage"]["properties"]["content"]["description"]


# -- 9. flags --------------------------------------------------------------------------------------------


def fd_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fd_server", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, message", [
    (["--port", "99999"], "--port: must be a port from 1 to 65535"),
    (["--port", "-1"], "--port: must be a port from 1 to 65535"),
    (["--max-model-len", "-5"], "--max-model-len: must be a positive integer"),
    (["--max-num-seqs", "0"], "--max-num-seqs: must be a positive integer"),
    (["--request-timeout", "-1"], "--request-timeout: must be a finite number of seconds"),
    (["--max-concurrency", "0"], "--max-concurrency: must be a positive integer"),
])
def test_bad_flag_values_are_refused_by_the_parser(args, message):
    out = fd_serve(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "starting the engine" not in out.stderr


def test_a_flag_the_backend_cannot_honour_is_refused_before_the_engine_starts(tiny_model):
    out = fd_serve("--model", tiny_model, "--quantization", "wint8", "--port", "0")
    assert out.returncode == 2, out.stderr
    assert "fd: error: --quantization wint8" in out.stderr and "starting the engine" not in out.stderr


def test_a_busy_port_is_named(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = fd_serve("--model", tiny_model, "--host", "127.0.0.1", "--port", str(port))
    assert out.returncode == 2, out.stderr
    assert f"fd: error: --port {port}: cannot listen on 127.0.0.1:{port}: it is already in use" in out.stderr
    assert "starting the engine" not in out.stderr


def test_port_0_logs_the_real_port_and_an_open_server_warns(tiny_model, tmp_path):
    log_path = tmp_path / "port0.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "fd_server", "--model", tiny_model, "--host", "0.0.0.0",
                                 "--port", "0", "--num-kv-blocks", "64"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (found := re.search(r"fd serving .* on http://0\.0\.0\.0:(\d+)", log_path.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        port = int(found.group(1))
        assert port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        text = log_path.read_text()
        assert "without --api-key" in text and "0.0.0.0" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()


# -- the fuzz ---------------------------------------------------------------------------------------------


def test_fuzz_edges_no_5xx_and_always_healthy(server):
    """Request bodies biased to the edges (huge and negative integers, long lists, odd Unicode,
    wrong types) for a bounded time (``FD_FUZZ_SECONDS``, default 60): never a 5xx, always the
    OpenAI error shape, and the server healthy after every example."""
    from hypothesis import HealthCheck, given, settings

    from tests.fuzz_bodies import request_bodies

    budget = float(os.environ.get("FD_FUZZ_SECONDS", "60"))
    deadline = time.monotonic() + budget
    seen: dict[int, int] = {}
    http = httpx.Client(base_url=server.url, headers={**AUTH, "Content-Type": "application/json"}, timeout=120)

    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=request_bodies(NAME))
    def check(case):
        path, body = case
        r = http.post(path, content=body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (body[:500], r.text[:500])
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, r.text
        assert http.get("/health").status_code == 200, (body[:500], server.log())

    try:
        while time.monotonic() < deadline:  # rounds of fresh random examples until the budget is spent
            check()
    finally:
        http.close()
    print(f"fuzz: {sum(seen.values())} requests in {budget:g} s, by status {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= 20, seen
    assert 200 in seen and 400 in seen, seen
    assert_serving(server)
