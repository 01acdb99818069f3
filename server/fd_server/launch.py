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
import sys
from collections.abc import Sequence
from typing import Any

from fd_core import errors
from fd_core.cluster.config import SchedulerConfig
from fd_core.engine.config import EngineConfig
from fd_core.errors import ConfigError
from fd_core.heap import freeze_startup_heap
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
          scheduler: SchedulerConfig | None = None, router: bool = False, api_server_count: int = 1) -> int:
    """Run the server until it is stopped; returns the process exit status. ``metrics_port``:
    a second port that serves /metrics alone (FastDeploy's --metrics-port); ``log_requests``:
    a log line per request received and finished (``--disable-log-requests`` turns them off);
    ``scheduler``: how the instance joins a cluster (``--scheduler-name global``): a Redis that
    cannot be reached stops the start with one line naming its host and port. ``router``: serve
    the cluster's instances instead of an engine of its own (``fd router``, whose
    ``engine_config`` only names the model for its tokenizer). ``api_server_count``: HTTP
    processes on the one listening socket and the one engine core (``_serve_several``)."""
    configure_default(role="server")  # fd serve has configured it already (--log-level)
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: a port is a number from 1 to 65535 (or 0 for any free one)")
    if api_server_count < 1:
        raise ConfigError(f"--api-server-count {api_server_count}: at least 1 HTTP process")
    if api_server_count > 1 and (router or (scheduler is not None and scheduler.is_global)):
        raise ConfigError(f"--api-server-count {api_server_count}: one HTTP process only in a cluster "
                          f"(--scheduler-name global or splitwise, fd router)")
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
        if api_server_count > 1:
            return asyncio.run(_serve_several(api_server_count, engine_config, sock, host, port, names, api_key,
                                              limits, log_requests, parsing, metrics_sock))
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


async def _serve_several(count: int, engine_config: EngineConfig, sock: socket.socket, host: str, port: int,
                         names: list[str], api_key: str | None, limits: ServerLimits, log_requests: bool,
                         parsing: ChatParsing | None, metrics_sock: socket.socket | None) -> int:
    """``count`` HTTP processes (``_api_server``) accept on ``sock`` and share one engine core,
    which this process spawns and stops (``CoreHandle``). Their metrics meet in a
    ``prometheus_client`` multiprocess folder, so any of them answers /metrics for all. A stop
    signal reaches the HTTP processes (each drains its requests), then the core stops. An HTTP
    process that exits on its own (the engine could not start: 2; it died: 1) stops the rest,
    and its status is this one's."""
    import multiprocessing
    import shutil
    import tempfile

    from fd_core.engine.core_handle import CoreHandle, client_addresses

    metrics_dir = tempfile.mkdtemp(prefix="fd-metrics-")
    folder = tempfile.mkdtemp(prefix="fd-api-")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    pairs = [client_addresses(folder, k) for k in range(count)]
    log.info("fd: starting the engine for %s, served by %d HTTP processes", engine_config.model, count)
    core = CoreHandle.spawn(engine_config, pairs)
    children: list[Any] = []
    code = 0
    try:
        # the HTTP processes start once the engine is ready: its failure is raised here, once
        waiting = asyncio.ensure_future(core.wait_ready(900.0))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([waiting, stopping], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            waiting.cancel()
        if not waiting.done() or waiting.cancelled():
            log.info("fd: stopped during start-up")
            return 1
        waiting.result()
        spawn = multiprocessing.get_context("spawn")
        # the children read PROMETHEUS_MULTIPROC_DIR when they import prometheus_client
        env_before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        try:
            for k in range(count):
                child = spawn.Process(target=_api_server, name=f"fd-api-server-{k}", args=(
                    engine_config, sock, host, port, names, api_key, limits, log_requests, parsing,
                    metrics_sock if k == 0 else None, (pairs[k], core.pid, k, count), effective_level()))
                child.start()
                children.append(child)
        finally:
            if env_before is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = env_before
        while not stop.is_set():
            ended = [c for c in children if not c.is_alive()]
            if ended:
                code = max(c.exitcode or 0 for c in ended) or 1
                log.error("fd: HTTP process %s exited with status %s; stopping the others", ended[0].name,
                          ended[0].exitcode)
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
    finally:
        for child in children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGTERM)  # each drains its requests (GRACEFUL_SHUTDOWN_S)
        deadline = loop.time() + GRACEFUL_SHUTDOWN_S + ENGINE_SHUTDOWN_S
        while any(c.is_alive() for c in children) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for child in children:
            if child.is_alive():
                child.kill()
            child.join()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        # a core that failed to start has exited already; one stopped during its start is not asked
        await core.stop(ask=bool(children), grace=ENGINE_SHUTDOWN_S if children else 2.0)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(metrics_dir, ignore_errors=True)
        log.info("fd: stopped")
    return code


def _api_server(engine_config: EngineConfig, sock: socket.socket, host: str, port: int, names: list[str],
                api_key: str | None, limits: ServerLimits, log_requests: bool, parsing: ChatParsing | None,
                metrics_sock: socket.socket | None, attach: tuple, log_level: int | str) -> None:
    """One HTTP process of ``_serve_several``: ``_serve`` on a client attached to the shared
    core. Exits 2 when the engine could not start (the error printed as ``fd`` prints it)."""
    from fd_core.errors import FdError
    from fd_core.logs import configure

    configure(log_level, role="server")
    # out of the terminal's process group: a Ctrl-C reaches the launcher alone, which sends one
    # SIGTERM (a second signal would make uvicorn cut the requests it is draining)
    os.setpgrp()
    try:
        code = asyncio.run(_serve(engine_config, sock, host, port, names, api_key, limits, log_requests, parsing,
                                  metrics_sock, attach=attach))
    except FdError as exc:
        print(f"fd: error: {exc}", file=sys.stderr, flush=True)
        code = 2
    sys.exit(code)


async def _serve(engine_config: EngineConfig, sock: socket.socket, host: str, port: int, names: list[str],
                 api_key: str | None, limits: ServerLimits, log_requests: bool, parsing: ChatParsing | None,
                 metrics_sock: socket.socket | None = None, scheduler: SchedulerConfig | None = None,
                 router: bool = False, attach: tuple | None = None) -> int:
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
    elif attach is None:
        client_class = AsyncEngineClient
        log.info("fd: starting the engine for %s", engine_config.model)
    try:
        if attach is not None:  # one of several HTTP processes: ((input, output), core pid, index, count)
            client = await AsyncEngineClient.attach(engine_config, *attach)
        else:
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
        # this process is set up (engine client, tokenizer, app): out of the GC's full collections
        # (here, not in build_app, whose callers in tests and embedding applications own their heap)
        freeze_startup_heap()

        async def announce() -> None:
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.05)
            auth = "API key required" if api_key else "no API key"
            if attach is None:
                log.info("fd serving %s on http://%s:%d (%s)", name, host, port, auth)
            elif attach[2] == 0:  # one line for the HTTP processes
                log.info("fd serving %s on http://%s:%d (%s, %d HTTP processes)", name, host, port, auth, attach[3])

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

