"""Starting and stopping a server under test, for the benchmark scripts in this folder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request


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
