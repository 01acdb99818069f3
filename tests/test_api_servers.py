"""``fd serve --api-server-count N``: N HTTP processes on one port and one engine core."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests import checkpoints
from tests.servers import API_KEY, Server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(checkpoints.make_llama(tmp_path_factory.mktemp("api")))


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmdline:
                found.append(int(entry.name))
    return found


def complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=60, headers=HEADERS) as client:
        if not stream:
            r = client.post(url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text = []
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)


def test_two_http_processes_serve_one_engine(model, tmp_path):
    prompts = [f"the {word} of the day" for word in ("cat", "sun", "rain", "tea", "sea", "map")]
    with Server(model, tmp_path / "one.log", "--api-key", API_KEY, "--max-model-len", "128",
                "--served-model-name", "m") as one:
        want = [complete(one.url, p, stream=False) for p in prompts]
    server = Server(model, tmp_path / "two.log", "--api-key", API_KEY, "--max-model-len", "128",
                    "--served-model-name", "m", "--api-server-count", "2")
    with server:
        spawned = children(server.proc.pid)
        assert len(spawned) == 3, server.log()  # the engine core and two HTTP processes
        jobs = [(p, stream) for p in prompts for stream in (False, True)] * 2
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda job: complete(server.url, *job), jobs))
        assert got == [want[prompts.index(p)] for p, _ in jobs]
        # whichever process answers, /metrics counts every process's requests
        for _ in range(6):
            assert server.metrics()["fd:e2e_request_latency_seconds_count"] == len(jobs)
        assert "2 HTTP processes" in (tmp_path / "two.log").read_text()
    assert server.proc.returncode == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in spawned), server.log()


@pytest.mark.parametrize("flags,message", [
    (["--api-server-count", "0"], "--api-server-count 0: at least 1 HTTP process"),
    (["--api-server-count", "2", "--scheduler-name", "global"], "one HTTP process only in a cluster"),
])
def test_a_count_that_cannot_run_is_refused_at_start(model, flags, message):
    done = subprocess.run([sys.executable, "-m", "fd_server", "--model", model, "--port", "0", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_an_engine_that_cannot_start_is_reported_once(model):
    """The launcher waits for the engine before it starts the HTTP processes, so the engine's
    own error is the one printed, once, and the status is fd's for a failed start."""
    done = subprocess.run([sys.executable, "-m", "fd_server", "--model", model, "--port", "0", "--max-model-len",
                           "100000", "--api-server-count", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("exceeds the model's context length") == 1, done.stderr[-2000:]
