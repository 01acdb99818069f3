"""fd_core.bench.phases: the timer the step-phase benchmarks wrap engine functions with."""

import time
import types

import pytest

from fd_core.bench.phases import PhaseTimer


def test_wrapped_functions_keep_their_result_and_add_their_time():
    owner = types.SimpleNamespace(work=lambda x: (time.sleep(0.01), x * 2)[1])
    timer = PhaseTimer()
    timer.wrap(owner, "work", "work")
    assert owner.work(3) == 6
    assert owner.work(4) == 8
    assert 0.02 <= timer.spent["work"] < 1.0


def test_time_is_counted_when_the_function_raises():
    def fails():
        time.sleep(0.01)
        raise ValueError("no")

    timer = PhaseTimer()
    wrapped = timer.timed("fails", fails)
    with pytest.raises(ValueError, match="no"):
        wrapped()
    assert timer.spent["fails"] >= 0.01
