"""``fd bench serve`` against a fake OpenAI-compatible server with known delays.

The fake streams one token per chunk: it sleeps ``first_delay`` before the first and ``gap``
between the others. Timing checks are one-sided (a measured figure is at least what the server
slept), so a slow or busy machine cannot make them fail.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fd_core.bench import serve

pytest.importorskip("httpx")  # serve imports it only when it runs

FIRST_DELAY = 0.05
GAP = 0.01


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.first_delay = FIRST_DELAY
        self.gap = GAP
        self.send_usage = True
        self.fail_every = 0  # every Nth generation request answers 500
        self.reject_extra_fields = False  # answer 400 to bodies with ignore_eos, as a strict server would
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: Any) -> None:  # keep pytest's output clean
        pass

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        with srv.lock:
            srv.bodies.append(body)
            number = len(srv.bodies)
        if srv.fail_every and number % srv.fail_every == 0:
            self._json(500, {"error": {"message": "injected failure"}})
            return
        if srv.reject_extra_fields and "ignore_eos" in body:
            self._json(400, {"error": {"message": "unknown field ignore_eos"}})
            return
        chat = self.path == "/v1/chat/completions"
        # HTTP/1.0 with no Content-Length: the body ends when the connection closes, as SSE allows.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def event(payload: Any) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.wfile.write(f"data: {data}\n\n".encode())

        if chat:  # a role-only first chunk, as OpenAI sends: no content, so no token yet
            event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        self.wfile.write(b": ping\n\n")
        for i in range(body["max_tokens"]):
            time.sleep(srv.first_delay if i == 0 else srv.gap)
            piece = f" w{i}"
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            event({"choices": [choice]})
        if srv.send_usage and body.get("stream_options", {}).get("include_usage"):
            event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}})
        event("[DONE]")


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def bench(argv: list[str]) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(argv)
    rc = serve.run(args)
    report = json.loads(Path(args.json).read_text()) if args.json and Path(args.json).exists() else {}
    return rc, report


def test_chat_figures_follow_the_server_delays(fake: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sub" / "result.json"
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "6", "--concurrency", "3",
                        "--input-len", "20", "--output-len", "8", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["params"]["model"] == "fake-model"  # asked GET /v1/models
    assert report["token_counts_from"] == "usage"
    assert report["total_output_tokens"] == 6 * 8
    assert report["total_input_tokens"] == 6 * 7
    ttft, tpot, itl, e2e = (report[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))
    # One-sided bounds from the injected sleeps, plus a generous ceiling against nonsense units.
    assert FIRST_DELAY * 1000 <= ttft["p50"] <= ttft["p99"] < 5000
    assert GAP * 1000 <= itl["p50"] < 5000
    assert GAP * 1000 <= tpot["mean"] < 5000
    assert (FIRST_DELAY + 7 * GAP) * 1000 <= e2e["p50"] < 10000
    assert ttft["mean"] <= e2e["mean"]
    assert report["duration_s"] * 1000 >= e2e["p99"]  # 6 requests, 3 at a time: at least two rounds
    assert report["duration_s"] >= 2 * (FIRST_DELAY + 7 * GAP)
    assert report["output_tokens_per_s"] == pytest.approx(48 / report["duration_s"])
    assert report["requests_per_s"] == pytest.approx(6 / report["duration_s"])
    assert set(report["machine"]) >= {"hostname", "cpu_count", "platform"}
    assert report["date"].startswith("20")

    sent = fake.bodies[-1]  # what a server that honours them needs to produce exactly 8 tokens
    assert sent["stream"] is True and sent["max_tokens"] == 8
    assert sent["ignore_eos"] is True and sent["min_tokens"] == 8
    assert sent["stream_options"] == {"include_usage": True}
    assert len(sent["messages"][0]["content"].split()) == 20
    assert len(fake.bodies) == 7  # 1 warm-up + 6 timed
    timed = {b["messages"][0]["content"] for b in fake.bodies[1:]}
    assert len(timed) == 6 and fake.bodies[0]["messages"][0]["content"] not in timed  # no cache hits

    table = capsys.readouterr().out
    for label in ("requests completed / failed", "6 / 0", "TTFT", "TPOT", "ITL", "E2E", "output tokens/s"):
        assert label in table


def test_completions_without_usage_counts_chunks(fake: FakeServer, tmp_path: Path) -> None:
    fake.send_usage = False
    rc, report = bench(["--base-url", fake.url, "--endpoint", "completions", "--model", "given",
                        "--num-prompts", "4", "--input-len", "10", "--output-len", "5", "--warmup", "0",
                        "--json", str(tmp_path / "r.json")])
    assert rc == 0 and report["completed"] == 4
    assert report["token_counts_from"] == "chunks"
    assert report["total_output_tokens"] == 4 * 5
    assert report["total_input_tokens"] == 4 * 10  # the requested length, lacking the server's count
    assert fake.bodies[0]["model"] == "given" and "prompt" in fake.bodies[0]
    assert report["itl_ms"]["p50"] >= GAP * 1000


def test_failures_are_counted_not_fatal(fake: FakeServer, tmp_path: Path, capsys) -> None:
    fake.fail_every = 3
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "9", "--concurrency", "4", "--output-len", "3",
                        "--warmup", "0", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    assert report["completed"] == 6 and report["failed"] == 3
    assert report["errors"] and all("HTTP 500" in e for e in report["errors"])
    assert report["total_output_tokens"] == 6 * 3  # failed requests add nothing
    assert "injected failure" in capsys.readouterr().out


def test_unreachable_server_reports_every_request_failed(tmp_path: Path) -> None:
    probe = FakeServer()  # take a free port, then close it so nothing listens there
    url = probe.url
    probe.server_close()
    rc, report = bench(["--base-url", url, "--model", "m", "--num-prompts", "3", "--warmup", "0",
                        "--timeout", "5", "--json", str(tmp_path / "r.json")])
    assert rc == 1
    assert report["completed"] == 0 and report["failed"] == 3
    assert report["ttft_ms"]["p50"] is None


def test_no_model_list_is_an_error_not_a_crash(tmp_path: Path, capsys) -> None:
    probe = FakeServer()
    url = probe.url
    probe.server_close()
    rc, _ = bench(["--base-url", url, "--num-prompts", "1", "--timeout", "5"])
    assert rc == 1
    assert "cannot benchmark" in capsys.readouterr().err


def test_server_rejecting_extra_fields_gets_plain_requests(fake: FakeServer, tmp_path: Path) -> None:
    fake.reject_extra_fields = True
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "3", "--output-len", "4", "--warmup", "1",
                        "--json", str(tmp_path / "r.json")])
    assert rc == 0 and report["completed"] == 3 and report["failed"] == 0
    assert report["params"]["length_fields_sent"] is False
    assert all("ignore_eos" not in b for b in fake.bodies[-3:])


def test_rate_limited_arrivals_take_at_least_their_gaps(fake: FakeServer, tmp_path: Path) -> None:
    fake.first_delay = fake.gap = 0.0
    rate, n, seed = 40.0, 8, 3
    rc, report = bench(["--base-url", fake.url, "--num-prompts", str(n), "--request-rate", str(rate),
                        "--seed", str(seed), "--output-len", "2", "--warmup", "0", "--json", str(tmp_path / "r.json")])
    assert rc == 0 and report["completed"] == n
    assert report["duration_s"] >= sum(serve.arrival_gaps(n, rate, seed))


def test_workload_is_deterministic() -> None:
    a = serve.make_prompts(5, 30, seed=1)
    assert a == serve.make_prompts(5, 30, seed=1)
    assert a != serve.make_prompts(5, 30, seed=2)
    assert len(set(a)) == 5 and all(len(p.split()) == 30 for p in a)
    gaps = serve.arrival_gaps(2000, 100.0, seed=0)
    assert gaps == serve.arrival_gaps(2000, 100.0, seed=0)
    assert sum(gaps) / len(gaps) == pytest.approx(0.01, rel=0.15)
    assert serve.arrival_gaps(3, float("inf"), seed=0) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert serve.percentile(values, 50) == pytest.approx(2.5)
    assert serve.percentile(values, 0) == 1.0 and serve.percentile(values, 100) == 4.0
    assert serve.percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert serve.distribution_ms([0.001, 0.003])["mean"] == pytest.approx(2.0)


def test_bad_options_are_refused(capsys) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(["--concurrency", "0"])) == 2
    assert serve.run(parser.parse_args(["--extra-body", "[1]"])) == 2
    assert "must" in capsys.readouterr().err
