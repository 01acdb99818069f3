"""Every op implementation against the NumPy specification (cases: ``fd_core.testing.opcases``)."""

from __future__ import annotations

import pytest

from fd_core.testing.opcases import run_case


def test_op_matches_the_spec(fd_backend, fd_op_case, fd_op_impl):
    if fd_op_case is None:
        fd_backend.require()
        pytest.fail(f"{fd_backend.device}: no op implementation to test")
    memory = fd_backend.memory()
    fn = fd_backend.implementations(fd_op_case.op, fd_op_case.context())[fd_op_impl]
    sample_async = None
    if fd_op_case.op == "deferred_bitmask":  # used through the sample_async the engine would choose
        sample_async = next(iter(fd_backend.implementations("sample_async", fd_op_case.context()).values()), None)
    run_case(fd_op_case, fn, memory, fd_op_impl, sample_async)
