"""``fd serve``: check the configuration, start the engine-core process, serve the HTTP API
with uvicorn, stop both.

Exit status: 0 after a normal shutdown (SIGINT/SIGTERM: requests in flight get up to
``GRACEFUL_SHUTDOWN_S`` to finish, then the engine is shut down); 1 when the engine died while
serving (see the lifecycle in ``fd_server.app``: the server exits ``FD_ENGINE_DEAD_EXIT_S``
seconds, default 5, after the engine died, so that a supervisor restarts it). A configuration
the backend cannot run, a port that cannot be bound, or an engine that cannot start raises its
fd error to the caller before anything is served (``fd`` prints it and exits 2); all but the
last are found before the engine process starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import json
import logging
import os
import signal
import socket
from collections.abc import Sequence
from typing import Any

from fd_core import errors
from fd_core.cluster.config import SchedulerConfig
from fd_core.engine.config import EngineConfig
from fd_core.errors import ConfigError
from fd_core.logs import configure_default, effective_level
from fd_server.limits import ServerLimits
from fd_server.tools import ChatParsing

log = logging.getLogger("fd_server")

DEFAULT_DEAD_EXIT_S = 5.0
GRACEFUL_SHUTDOWN_S = 20  # under Kubernetes' default 30 s termination grace
ENGINE_SHUTDOWN_S = 30.0


def serve(engine_config: EngineConfig, host: str, port: int, served_model_name: str | Sequence[str] | None,
          api_key: str | None, limits: ServerLimits | None = None, metrics_port: int | None = None,
          log_requests: bool = True, parsing: ChatParsing | None = None,
          scheduler: SchedulerConfig | None = None, router: bool = False) -> int:
    """Run the server until it is stopped; returns the process exit status. ``metrics_port``:
    a second port that serves /metrics alone (FastDeploy's --metrics-port); ``log_requests``:
    a log line per request received and finished (``--disable-log-requests`` turns them off);
    ``scheduler``: how the instance joins a cluster (``--scheduler-name global``): a Redis that
    cannot be reached stops the start with one line naming its host and port. ``router``: serve
    the cluster's instances instead of an engine of its own (``fd router``, whose
    ``engine_config`` only names the model for its tokenizer)."""
    configure_default(role="server")  # fd serve has configured it already (--log-level)
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: a port is a number from 1 to 65535 (or 0 for any free one)")
    limits = limits or ServerLimits()
    api_key = api_key or os.environ.get("FD_API_KEY") or None
    names = ([served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])) \
        or [engine_config.model]
    if not router:
        _check_config(engine_config)
    if scheduler is not None and scheduler.is_global:
        from fd_core.cluster.global_scheduler import connect

        connect(scheduler.address).close()  # before minutes of loading: a Redis that is not there
    # Bound before the engine loads (which can take minutes) so a taken port fails at once;
    # nothing listens on it until the engine is ready, so probes see a refused connection.
    try:
        sock = _bind(host, port)
    except OSError as exc:
        why = "it is already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(f"--port {port}: cannot listen on {host}:{port}: {why}; choose another --port "
                          f"(0 takes any free one) or stop what holds it") from None
    port = sock.getsockname()[1]  # the port given, or the one the system chose for --port 0
    metrics_sock = None
    if metrics_port is not None:
        try:
            metrics_sock = _bind(host, metrics_port)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"--metrics-port {metrics_port}: cannot listen on {host}:{metrics_port}: "
                              f"{exc.strerror or exc}") from None
    if not api_key and not _is_loopback(host):
        log.warning("fd: listening on %s without --api-key: anyone who can reach this address can use the "
                    "server; set --api-key (or FD_API_KEY) or --host 127.0.0.1", host)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return asyncio.run(_serve(engine_config, sock, host, port, names, api_key, limits, log_requests, parsing,
                                  metrics_sock, scheduler, router))
    except KeyboardInterrupt:
        return 130
    finally:
        sock.close()
        if metrics_sock is not None:
            metrics_sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _check_config(config: EngineConfig) -> None:
    """Refuse a configuration the backend cannot run before anything starts, as the engine
    process would after its start-up (``core.select_platform``, which it runs again).

    In a forked child where the platform has ``fork``: checking imports the backends (their
    tensor libraries: +250 MB for Paddle) and asks the device for its capabilities, and this
    process, which only serves HTTP, should hold neither. Measured: the refusal of an
    unsupported ``--quantization`` comes after 1.2 s instead of 3.2 s."""
    from fd_core.engine.core import select_platform

    config = dataclasses.replace(config)  # the engine process resolves the defaults itself
    if not hasattr(os, "fork"):
        select_platform(config)
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer through the pipe, never return into the caller's code
        code = 0
        try:
            os.close(read)
            try:
                select_platform(config)
                answer: dict[str, str] = {}
            except Exception as exc:  # noqa: BLE001 - every refusal goes to the parent
                answer = {"type": type(exc).__name__, "message": str(exc)}
            os.write(write, json.dumps(answer).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    try:
        answer = json.loads(b"".join(chunks) or b"null")
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        log.warning("fd: the configuration check ended without an answer (status %s); the engine checks it "
                    "again as it starts", status)
        return
    if answer:
        raise errors.rebuild(answer["type"], answer["message"], ConfigError)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only localhost is known to stay on this machine
        return False


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _dead_exit_s() -> float:
    raw = os.environ.get("FD_ENGINE_DEAD_EXIT_S", "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_DEAD_EXIT_S
    except ValueError:
        log.warning("FD_ENGINE_DEAD_EXIT_S=%r is not a number; using %s", raw, DEFAULT_DEAD_EXIT_S)
        return DEFAULT_DEAD_EXIT_S


async def _serve(engine_config: EngineConfig, sock: socket.socket, host: str, port: int, names: list[str],
                 api_key: str | None, limits: ServerLimits, log_requests: bool, parsing: ChatParsing | None,
                 metrics_sock: socket.socket | None = None, scheduler: SchedulerConfig | None = None,
                 router: bool = False) -> int:
    import uvicorn

    from fd_core.engine.client import AsyncEngineClient
    from fd_server.app import build_app

    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    # Until uvicorn takes the signals over, a stop request cancels the start-up cleanly
    # (the engine client then stops the process it was starting).
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main.cancel)
    if router:
        from fd_core.cluster.client import ClusterClient as client_class

        log.info("fd: routing to the cluster %r for %s", scheduler.topic, engine_config.model)
    else:
        client_class = AsyncEngineClient
        log.info("fd: starting the engine for %s", engine_config.model)
    try:
        client = await client_class.start(engine_config, scheduler=scheduler)
    except asyncio.CancelledError:
        log.info("fd: stopped during start-up")
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    # uvicorn re-raises the signals it caught once it has stopped; with these handlers in
    # place that re-raise is harmless and the engine below still gets shut down.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore_late_signal)

    exit_code = 0
    helpers: list[asyncio.Task[Any]] = []
    try:
        app = build_app(client, names, api_key=api_key, limits=limits, log_requests=log_requests, parsing=parsing)
        name = names[0]
        if metrics_sock is not None:
            helpers.append(asyncio.ensure_future(_serve_metrics(app, metrics_sock)))
        # log_config=None: uvicorn's lines go through fd's handler and format (fd_core.logs)
        config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=effective_level(),
                                lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        server = uvicorn.Server(config)

        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.05)
            auth = "API key required" if api_key else "no API key"
            log.info("fd serving %s on http://%s:%d (%s)", name, host, port, auth)

        async def exit_when_engine_dies() -> None:
            nonlocal exit_code
            await app.state.monitor.dead.wait()
            grace = _dead_exit_s()
            log.error("fd: the engine died; shutting the server down in %.1f s with exit status 1", grace)
            await asyncio.sleep(grace)
            exit_code = 1
            server.should_exit = True

        helpers = [asyncio.ensure_future(announce()), asyncio.ensure_future(exit_when_engine_dies())]
        try:
            await server.serve(sockets=[sock])
        except SystemExit:  # uvicorn's way out when its start-up fails
            log.error("fd: the HTTP server could not start")
            return 1
        if not server.started:
            return 1
        return exit_code
    finally:
        for task in helpers:
            task.cancel()
        await _shutdown(client)


async def _serve_metrics(app: Any, sock: socket.socket) -> None:
    """/metrics alone on ``sock`` until cancelled (when the main server stops)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    from fd_server.metrics import CONTENT_TYPE

    async def metrics(_request: Any) -> Response:
        return Response(app.state.metrics.render(), media_type=CONTENT_TYPE)

    class Quiet(uvicorn.Server):
        def capture_signals(self):  # the main server owns SIGINT/SIGTERM
            return contextlib.nullcontext()

    server = Quiet(uvicorn.Config(Starlette(routes=[Route("/metrics", metrics)]), log_level="warning",
                                  lifespan="off"))
    try:
        await server.serve(sockets=[sock])
    finally:
        server.should_exit = True


async def _shutdown(client: Any) -> None:
    try:
        await asyncio.wait_for(client.shutdown(), ENGINE_SHUTDOWN_S)
    except Exception as exc:  # a dead engine may not shut down politely; nothing is left to save
        log.warning("fd: engine shutdown: %s", exc or type(exc).__name__)
    log.info("fd: stopped")


def _ignore_late_signal(signum: int, _frame: Any) -> None:
    log.debug("fd: signal %s while stopping; still shutting down the engine", signal.Signals(signum).name)

