"""``tcp``: fd-core's KV-cache connector (``fd_core.interfaces.kv_transfer``), ZeroMQ over TCP.

One background thread per connector owns every socket: a ROUTER that receives (on a decode
instance) and a DEALER per peer that sends (on a prefill instance). The engine's thread hands it
sends through an in-process socket and picks up what ended from queues, so neither a slow peer
nor a large transfer holds a step, and the times measured are the transfer's own: a send's
clock stops when the receiver's thread has the whole message and acknowledged it, not when the
receiving engine gets round to it. Arrays go as message frames without a copy on the sending
side; the receiver keeps them in the frames it read.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

import msgspec
import numpy as np
import zmq

from fd_core.interfaces.kv_transfer import KVTransferError, Received, TransferDone

log = logging.getLogger("fd.cluster")

POLL_MS = 20  # how often the thread looks at its deadlines while nothing arrives


class TcpTransfer:
    name = "tcp"

    def __init__(self, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._commands_address = f"inproc://fd-kv-{uuid.uuid4().hex}"
        self._commands_in = self._ctx.socket(zmq.PULL)
        self._commands_in.bind(self._commands_address)
        self._commands = self._ctx.socket(zmq.PUSH)  # used by the engine's thread only
        self._commands.connect(self._commands_address)
        self._router: zmq.Socket | None = None
        self._done: queue.SimpleQueue[TransferDone] = queue.SimpleQueue()
        self._arrived: queue.SimpleQueue[Received] = queue.SimpleQueue()
        self._listening = threading.Event()
        self._endpoint = ""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fd-kv-transfer", daemon=True)
        self._thread.start()

    # -- the engine's side --------------------------------------------------------------

    def listen(self, host: str, port: int = 0) -> str:
        self._commands.send_multipart([b"listen", host.encode(), str(port).encode()])
        if not self._listening.wait(10) or self._error is not None:
            raise KVTransferError(f"the tcp KV transfer could not listen on {host}:{port}: {self._error}")
        return self._endpoint

    def send(self, endpoint: str, request_id: str, header: bytes, arrays: list[np.ndarray]) -> None:
        if not endpoint.startswith("tcp://"):
            raise KVTransferError(f"the tcp KV transfer sends to tcp:// endpoints, not {endpoint!r}")
        arrays = [np.ascontiguousarray(a) for a in arrays]
        layout = msgspec.msgpack.encode([(a.dtype.str, list(a.shape)) for a in arrays])
        try:
            self._commands.send_multipart([b"send", endpoint.encode(), request_id.encode(), header, layout, *arrays],
                                          copy=False)
        except zmq.ZMQError as exc:
            raise KVTransferError(f"the tcp KV transfer is closed: {exc}") from None

    def completed(self) -> list[TransferDone]:
        return _drain(self._done)

    def received(self) -> list[Received]:
        return _drain(self._arrived)

    def close(self) -> None:
        if self._thread.is_alive():
            self._commands.send_multipart([b"stop"])
            self._thread.join(5)
        self._commands.close(linger=0)
        self._commands_in.close(linger=0)
        self._ctx.term()

    # -- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._commands_in, zmq.POLLIN)
        peers: dict[str, zmq.Socket] = {}
        pending: dict[tuple[str, str], tuple[float, int]] = {}  # (endpoint, request id) -> (start, bytes)
        try:
            while True:
                for sock, _ in poller.poll(POLL_MS):
                    if sock is self._commands_in:
                        frames = sock.recv_multipart(copy=False)
                        verb = frames[0].bytes
                        if verb == b"stop":
                            return
                        if verb == b"listen":
                            self._bind(poller, frames[1].bytes.decode(), int(frames[2].bytes))
                        else:
                            self._start(poller, peers, pending, frames)
                    elif sock is self._router:
                        self._receive(sock)
                    else:
                        endpoint = next(e for e, peer in peers.items() if peer is sock)
                        self._acknowledged(sock, endpoint, pending)
                now = time.perf_counter()
                for key, (start, nbytes) in list(pending.items()):
                    if now - start > self.timeout:
                        del pending[key]
                        self._abandon(key[1])
                        self._done.put(TransferDone(key[1], nbytes, now - start,
                                                    f"no answer from {key[0]} within {self.timeout:g} s"))
                        # what is still queued for a peer that does not answer goes with it
                        sock = peers.pop(key[0], None)
                        if sock is not None:
                            poller.unregister(sock)
                            sock.close(linger=0)
        except BaseException as exc:  # noqa: BLE001 - reported to the engine's thread
            self._error = exc
            self._listening.set()
            log.exception("the tcp KV transfer's thread failed")
        finally:
            for sock in peers.values():
                sock.close(linger=0)
            if self._router is not None:
                self._router.close(linger=0)

    def _bind(self, poller: zmq.Poller, host: str, port: int) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        if port:
            router.bind(f"tcp://{host}:{port}")
        else:
            port = router.bind_to_random_port(f"tcp://{host}")
        self._router = router
        poller.register(router, zmq.POLLIN)
        self._endpoint = f"tcp://{host}:{port}"
        self._listening.set()

    def _start(self, poller: zmq.Poller, peers: dict, pending: dict, frames: list) -> None:
        endpoint, request_id = frames[1].bytes.decode(), frames[2].bytes.decode()
        sock = peers.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.connect(endpoint)
            poller.register(sock, zmq.POLLIN)
            peers[endpoint] = sock
        pending[(endpoint, request_id)] = (time.perf_counter(), self._payload_bytes(request_id, frames[5:]))
        sock.send_multipart([b"kv", *frames[2:5], *self._outgoing(request_id, frames[5:])], copy=False)

    def _payload_bytes(self, request_id: str, arrays: list[zmq.Frame]) -> int:
        """The bytes a send moves (its transfer statistics)."""
        return sum(len(f.buffer) for f in arrays)

    def _outgoing(self, request_id: str, arrays: list[zmq.Frame]) -> list:
        """What carries a send's arrays after its layout: here, the arrays themselves."""
        return arrays

    def _incoming(self, layout: list, frames: list[zmq.Frame]) -> list[np.ndarray]:
        """The arrays of a message that arrived (``_outgoing``'s frames)."""
        if len(layout) != len(frames):
            raise ValueError(f"{len(frames)} arrays for a layout of {len(layout)}")
        return [np.frombuffer(f.buffer, dtype=np.dtype(dtype)).reshape(shape) for f, (dtype, shape) in zip(frames, layout)]

    def _release(self, request_id: str) -> None:
        """A send was acknowledged (done or refused): what it held may go."""

    def _abandon(self, request_id: str) -> None:
        """A send was given up unanswered: its peer may still read what it held."""
        self._release(request_id)

    def _acknowledged(self, sock: zmq.Socket, endpoint: str, pending: dict) -> None:
        reply = sock.recv_multipart()
        request_id, error = reply[1].decode(), reply[2].decode()
        entry = pending.pop((endpoint, request_id), None)
        self._release(request_id)
        if entry is not None:
            start, nbytes = entry
            self._done.put(TransferDone(request_id, nbytes, time.perf_counter() - start, error))

    def _receive(self, router: zmq.Socket) -> None:
        frames = router.recv_multipart(copy=False)
        identity, request_id = frames[0], frames[2].bytes.decode()
        error = ""
        try:
            arrays = self._incoming(msgspec.msgpack.decode(frames[4].bytes), frames[5:])
            self._arrived.put(Received(request_id, frames[3].bytes, arrays, sum(a.nbytes for a in arrays)))
        except (ValueError, TypeError, RuntimeError, msgspec.DecodeError) as exc:
            error = f"the KV transfer was refused: {exc}"  # malformed, or the receiver could not take it
            log.error("dropped a KV transfer for %s: %s", request_id, error)
        router.send_multipart([identity, b"ack", request_id.encode(), error.encode()])


def _drain(q: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
