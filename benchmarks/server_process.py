"""Starting and stopping a server under test, for the benchmark scripts in this folder."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log_path: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Run ``cmd`` in its own process group (so ``stop`` takes its children too), output to a
    log; ``env``: variables set for it on top of this process's."""
    with open(log_path, "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=None if env is None else {**os.environ, **env})


def wait_ready(proc: subprocess.Popen, port: int, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(1)
    return False


def stop(proc: subprocess.Popen) -> None:
    """Stops a server started by ``start`` (its own process group)."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench_serve(port: int, concurrency: int, prompts: int, input_len: int, output_len: int, warmups: int = 2,
                extra: Sequence[str] = ()) -> dict:
    """``fd bench serve`` of random prompts against the completions endpoint on 127.0.0.1:``port``
    (``extra``: more of its flags); returns its saved results."""
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    try:
        subprocess.run([sys.executable, "-m", "fd_core.entrypoints.cli", "bench", "serve", "--base-url",
                        f"http://127.0.0.1:{port}", "--endpoint", "completions", "--max-concurrency", str(concurrency),
                        "--num-prompts", str(prompts), "--input-len", str(input_len), "--output-len", str(output_len),
                        "--num-warmups", str(warmups), "--save-result", str(out), *extra],
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
