"""A real ``fd serve`` (``python -m fd_server``) on a free loopback port, for the end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "e2e-key"
START_TIMEOUT_S = 180


async def leave_after(stream, chunks: int = 3) -> None:
    """Read ``chunks`` chunks of a streamed response, then hang up (a client that leaves early)."""
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == chunks:
            break
    await stream.close()


def plain_samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name.startswith("fd:") and set(sample.labels) <= {"model_name", "engine"}}


class Server:
    """One ``python -m fd_server`` process on a free loopback port."""

    def __init__(self, model: str, log_path: Path, *args: str, env: dict[str, str] | None = None,
                 command: list[str] | None = None, wait: bool = True) -> None:
        """``command``: what starts the server (default: this interpreter's ``-m fd_server``),
        e.g. another venv's ``fd serve``. ``wait=False``: return at once (several servers then
        load their models side by side); ``wait_ready()`` before using it."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [*(command or [sys.executable, "-m", "fd_server"]), "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self._started = time.monotonic()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "Server":
        deadline = self._started + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fd serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"fd serve was not ready in {START_TIMEOUT_S} s:\n{self.log()}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)

    def engine_core_pid(self) -> int:
        """The engine-core process: the server's child that multiprocessing spawned to run it."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and "spawn_main" in cmdline:
                return int(entry.name)
        raise AssertionError("no engine-core child process found")

    def metrics(self) -> dict[str, float]:
        """fd's samples labelled by nothing but the model and engine (``fd:num_requests_running``,
        ``fd:e2e_request_latency_seconds_count``), by sample name."""
        return plain_samples(httpx.get(self.url + "/metrics", timeout=10).text)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        """Stop the server; it must exit cleanly unless the block already failed (that error is
        the one to see)."""
        code = self.stop()
        if exc_type is None:
            assert code == 0, self.log()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def default_model_server(model: str, device: str, log_path: Path, *args: str, emulated: bool = False) -> Server:
    """``fd serve`` of the default model on ``device``; ``emulated``: a vendor backend emulated
    on the CPU (its own platform and op table, ``FD_EMULATE``). Skips the test where the model
    or the emulated backend is not installed."""
    import pytest

    from fd_core.loader import resolve_model

    try:
        resolve_model(model)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the default model is not installed: {exc}")
    env = {}
    if emulated:
        from tests.plugins.vendors import require_installed

        require_installed(device)
        env["FD_EMULATE"] = device
    server = Server(model, log_path, "--device", device, *args, env=env)
    server.device = device
    return server


def cuda_model_server(model: str, log_path: Path, *args: str) -> Server:
    """``fd serve --device cuda`` of the default model; skips the test without a CUDA device."""
    import pytest

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return default_model_server(model, "cuda", log_path, "--max-model-len", "2048", *args)


@contextlib.contextmanager
def fd_cluster(folder: Path, topic: str, joined: dict[str, list[str]], plain: dict[str, list[str]] | None = None,
               router: bool = False, ttl: int = 3):
    """A real ``redis-server``; ``fd serve`` instances of the default model joined to it through
    the global scheduler (``joined``: name -> their flags) and others not (``plain``), all loading
    side by side; ``fd router`` in front where ``router``. Yields (redis, {name: Server}), the
    router named "router"; stops them all."""
    from fd_core.loader import DEFAULT_MODEL
    from tests.redis_server import RedisServer

    redis = RedisServer(folder).start()
    scheduler = ["--scheduler-port", str(redis.port), "--scheduler-topic", topic, "--scheduler-ttl", str(ttl)]
    servers: dict[str, Server] = {}
    try:
        for name, args in (plain or {}).items():
            servers[name] = Server(DEFAULT_MODEL, folder / f"{name}.log", *args, wait=False)
        for name, args in joined.items():
            servers[name] = Server(DEFAULT_MODEL, folder / f"{name}.log", *args, *scheduler, wait=False)
        for server in servers.values():
            server.wait_ready()
        if router:
            servers["router"] = Server(DEFAULT_MODEL, folder / "router.log", "--api-key", API_KEY, *scheduler,
                                       command=[sys.executable, "-m", "fd_core.entrypoints.cli", "router"])
        yield redis, servers
    finally:
        for server in servers.values():
            server.stop()
        redis.stop()
