"""Capturing a CUDA graph with the garbage collector held off, tested without a GPU: the
capture's context is replaced by one that records whether automatic collection is on."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
graphs = pytest.importorskip("fd_backend_cuda.graphs")


@pytest.fixture
def capturing(monkeypatch):
    """``torch.cuda``'s capture calls replaced; yields what each capture saw of the collector."""
    seen: list[bool] = []

    class Capture:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            seen.append(gc.isenabled())

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    enabled = gc.isenabled()
    yield seen
    (gc.enable if enabled else gc.disable)()


def test_no_automatic_collection_while_capturing(capturing):
    """A collection during a capture may destroy a dropped engine's graphs, which invalidates
    the capture (seen in the conformance kit on an H200): off for the capture, on after."""
    gc.enable()
    _, output = graphs._captured(lambda: 7, None)
    assert output == 7 and capturing == [False] and gc.isenabled()


def test_collection_restored_after_a_failed_capture(capturing):
    gc.enable()
    runs = iter([None, RuntimeError("capture failed")])

    def run():
        failure = next(runs)
        if failure is not None:
            raise failure

    with pytest.raises(RuntimeError, match="capture failed"):
        graphs._captured(run, None)
    assert capturing == [False] and gc.isenabled()


def test_collection_left_off_where_it_was_off(capturing):
    gc.disable()
    graphs._captured(lambda: None, None)
    assert capturing == [False] and not gc.isenabled()
