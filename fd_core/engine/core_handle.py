"""The engine-core process as its clients see it: spawned once, for one client or several.

``CoreHandle.spawn`` starts ``core_process.run_core`` for the clients whose socket addresses it
is given (each client binds its own pair, see ``client.AsyncEngineClient``) and keeps two
sockets of its own, bound before the core starts: a control socket, through which ``stop`` asks
the core to exit, and a status socket, on which ``wait_ready`` gets the core's Ready or its
start-up failure even before any client is up. Whoever spawned the core owns
its handle: ``AsyncEngineClient.start`` for a server with one HTTP process, the launcher of
``fd serve --api-server-count N`` for several. A client in another process watches the core
by its pid (``CoreWatch``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import zmq

from fd_core import errors
from fd_core.cluster.config import SchedulerConfig
from fd_core.engine.config import EngineConfig
from fd_core.engine.core_process import run_core
from fd_core.engine.wire import CoreMessage, Failed, Ready, Shutdown
from fd_core.errors import BackendError
from fd_core.logs import effective_level

log = logging.getLogger("fd.engine")
_PROCFS = Path("/proc/self/stat").exists()  # a process's state (a zombie's "Z") is read there


def client_addresses(folder: str, index: int) -> tuple[str, str]:
    """Client ``index``'s (input, output) socket addresses in ``folder``: it binds both, the
    core connects."""
    return f"ipc://{folder}/input-{index}", f"ipc://{folder}/output-{index}"


async def await_ready(next_message: Callable[[], Awaitable[CoreMessage | None]], core: CoreHandle | CoreWatch,
                      timeout: float) -> Ready:
    """The core's Ready, from ``next_message`` (the next message, or None after a short wait);
    its start-up failure re-raised as the same fd error type; a BackendError when the core
    exits first or stays silent past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    exited_at = None
    while True:
        msg = await next_message()
        if isinstance(msg, Ready):
            return msg
        if isinstance(msg, Failed):
            raise errors.rebuild(msg.error_type, msg.message, BackendError)
        if msg is not None:
            continue  # nothing else comes before Ready
        now = time.monotonic()
        if not core.is_alive():  # a core that failed cleanly sent why before exiting: let it arrive
            exited_at = exited_at or now
            if now - exited_at > 1.0:
                raise BackendError(f"the engine core exited with code {core.exitcode} before it was ready")
        elif now > deadline:
            raise BackendError(f"the engine core was not ready within {timeout:g} s")


class CoreWatch:
    """Whether the core process with this pid lives, for a client that did not spawn it (and
    so cannot reap it: a core that died stays a zombie until its parent reaps it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if not _PROCFS:  # not Linux: a zombie looks alive here
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
            return True
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in ("Z", "X")


class CoreHandle:
    """The spawned core process, its control socket and their folder."""

    def __init__(self, process: multiprocessing.Process, control: zmq.Socket, status: zmq.Socket,
                 ctx: zmq.Context, folder: str) -> None:
        self.process = process
        self._control = control
        self._status = status
        self._ctx = ctx
        self._folder = folder

    @classmethod
    def spawn(cls, config: EngineConfig, clients: list[tuple[str, str]],
              scheduler: SchedulerConfig | None = None) -> CoreHandle:
        """Start the core for ``clients`` (each an (input, output) address pair)."""
        folder = tempfile.mkdtemp(prefix="fd-core-")
        ctx = zmq.Context()
        control = ctx.socket(zmq.PUSH)
        control.setsockopt(zmq.LINGER, 0)
        control.setsockopt(zmq.SNDHWM, 0)
        address = f"ipc://{folder}/control"
        control.bind(address)
        status = ctx.socket(zmq.PULL)
        status.setsockopt(zmq.LINGER, 0)
        status.bind(f"ipc://{folder}/status")
        # daemon: should the owner exit without stop(), multiprocessing still ends it
        process = multiprocessing.get_context("spawn").Process(
            target=run_core, name="fd-engine-core", daemon=True,
            args=(config, [address] + [i for i, _ in clients], [o for _, o in clients], os.getpid(),
                  effective_level(), scheduler, f"ipc://{folder}/status"),
        )
        process.start()
        return cls(process, control, status, ctx, folder)

    async def wait_ready(self, timeout: float) -> Ready:
        """The core's Ready on the status socket (``await_ready``)."""
        decoder = msgspec.msgpack.Decoder(CoreMessage)

        async def next_message() -> CoreMessage | None:
            if self._status.poll(0):
                return decoder.decode(self._status.recv())
            await asyncio.sleep(0.05)
            return None

        return await await_ready(next_message, self, timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()  # reaps the process once it has exited

    async def stop(self, ask: bool = True, grace: float = 5.0) -> None:
        """Wait ``grace`` seconds for the core to exit (after asking it to, if ``ask``), then
        terminate it, then kill it; then close the control socket."""
        try:
            if self.process.is_alive():
                if ask:
                    self._control.send(msgspec.msgpack.encode(Shutdown()), zmq.NOBLOCK)
                if not (grace and await self._wait_exit(grace)):
                    if grace:
                        log.warning("the engine core did not stop within %g s; terminating it", grace)
                    self.process.terminate()
                    if not await self._wait_exit(2.0):
                        self.process.kill()
                        await self._wait_exit(2.0)
        finally:
            self._control.close()
            self._status.close()
            self._ctx.term()
            shutil.rmtree(self._folder, ignore_errors=True)

    async def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.process.is_alive():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True


__all__ = ["CoreHandle", "CoreWatch", "await_ready", "client_addresses"]
