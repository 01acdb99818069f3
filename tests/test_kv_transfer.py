"""fd-core's KV-cache connectors (``fd_core.interfaces.kv_transfer``): ``tcp`` and ``nixl``, in
one process and between two, and a peer that never answers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from fd_core.errors import ConfigError
from fd_core.interfaces.kv_transfer import KVTransfer
from fd_core.plugins import get_registry
from tests.redis_server import free_port

PROTOCOLS = ["tcp", "nixl"]


def connector(protocol: str, timeout: float = 10.0):
    try:
        return get_registry().kv_transfer(protocol, timeout)
    except ConfigError as exc:  # nixl where its package is not installed
        pytest.skip(str(exc))


def arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((64, 3, 64)).astype(np.float32), rng.integers(-128, 127, (64, 3, 66), dtype=np.int8),
            rng.integers(0, 255, (32, 2, 66), dtype=np.uint8), np.arange(7, dtype=np.float32)]


def wait_for(get, seconds: float = 10.0) -> list:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = get()
        if got:
            return got
        time.sleep(0.005)
    raise AssertionError("nothing arrived")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_arrays_arrive_whole_and_the_sender_learns_when(protocol):
    sender, receiver = connector(protocol), connector(protocol)
    try:
        assert isinstance(sender, KVTransfer) and sender.name == protocol
        endpoint = receiver.listen("127.0.0.1")
        sent = arrays()
        sender.send(endpoint, "r1", b"header", sent)
        (got,) = wait_for(receiver.received)
        assert got.request_id == "r1" and got.header == b"header"
        assert got.nbytes == sum(a.nbytes for a in sent)
        for a, b in zip(got.arrays, sent):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        (done,) = wait_for(sender.completed)
        assert done.ok and done.request_id == "r1" and done.nbytes == got.nbytes and done.seconds > 0
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_between_two_processes(protocol):
    connector(protocol).close()  # skips where the protocol cannot run
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from fd_core.plugins import get_registry
        t = get_registry().kv_transfer({protocol!r}, 10.0)
        print(t.listen("127.0.0.1"), flush=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            got = t.received()
            if got:
                print(got[0].request_id, got[0].header.decode(), sum(float(a.astype("float64").sum()) for a in got[0].arrays), flush=True)
                time.sleep(0.5)  # the acknowledgement leaves
                break
            time.sleep(0.01)
        t.close()
    """)], stdout=subprocess.PIPE, text=True)
    sender = connector(protocol)
    try:
        lines = (line.strip() for line in child.stdout)  # NIXL logs to stdout too
        endpoint = next(line for line in lines if line.startswith("tcp://"))
        sent = arrays()
        sender.send(endpoint, "across", b"h", sent)
        (done,) = wait_for(sender.completed, 20)
        assert done.ok, done.error
        request_id, header, total = next(line for line in lines if line.startswith("across")).split()
        assert (request_id, header) == ("across", "h")
        assert float(total) == pytest.approx(sum(float(a.astype(np.float64).sum()) for a in sent))
    finally:
        sender.close()
        child.wait(30)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_peer_that_never_answers_fails_the_send_with_the_reason(protocol):
    sender = connector(protocol, timeout=0.5)
    try:
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        sender.send(endpoint, "lost", b"", arrays())
        (done,) = wait_for(sender.completed, 5)
        assert not done.ok and done.error == f"no answer from {endpoint} within 0.5 s"
    finally:
        sender.close()


def test_an_endpoint_of_another_kind_is_refused():
    from fd_core.interfaces.kv_transfer import KVTransferError

    sender = connector("tcp")
    try:
        with pytest.raises(KVTransferError, match="tcp:// endpoints"):
            sender.send("rdma://host", "r", b"", arrays())
    finally:
        sender.close()


def test_a_package_registers_a_connector_through_the_hook(tmp_path, monkeypatch):
    """A backend package's ``fd_kv_transfers`` hook: its connector is chosen by name, it cannot
    take the name of fd-core's own, and an unknown name's error lists what is installed."""
    from importlib import metadata

    from fd_core.plugins.registry import BackendRegistry

    (tmp_path / "fd_test_connector.py").write_text(textwrap.dedent("""
        from fd_core.cluster.tcp_transfer import TcpTransfer
        from fd_core.plugins import hookimpl

        FD_API_VERSION = "1.14"

        class Loopback(TcpTransfer):
            name = "loopback"

        @hookimpl
        def fd_kv_transfers():
            return {"loopback": Loopback, "tcp": Loopback}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ep = metadata.EntryPoint(name="fdtest", value="fd_test_connector", group="fd.backends")
    registry = BackendRegistry(entry_points=[ep])
    assert not registry.failures()
    transfer = registry.kv_transfer("loopback", 1.0)
    try:
        assert transfer.name == "loopback" and transfer.timeout == 1.0
    finally:
        transfer.close()
    tcp = registry.kv_transfer("tcp", 1.0)
    try:
        assert type(tcp).__name__ == "TcpTransfer"  # fd-core's, not the package's
    finally:
        tcp.close()
    assert {n: p for n, (_, p) in registry.transfers.items() if n != "loopback"} == {"tcp": "fd-core",
                                                                                     "nixl": "fd-core"}
    with pytest.raises(ConfigError, match=r"--cache-transfer-protocol mooncake: .*installed: tcp, nixl, loopback"):
        registry.kv_transfer("mooncake")
