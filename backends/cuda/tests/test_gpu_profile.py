"""gpu_profile.py's attribution of GPU time to kernels when launches overlap (runs on the CPU)."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")


def _module():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("gpu_profile_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_wait_under_programmatic_launch_is_the_kernel_aheads_time():
    gp = _module()
    # norm runs 0-2; gemv is launched at 1 and waits for it, then runs to 10; a gap; silu 12-13
    spans = [("gemv", 1.0, 10.0), ("norm", 0.0, 2.0), ("silu", 12.0, 13.0), ("gemv", 13.5, 15.0)]
    got = gp.exclusive_us(spans)
    assert got == {"norm": (2.0, 1), "gemv": (8.0 + 1.5, 2), "silu": (1.0, 1)}
    # the names' times add up to the union of the intervals
    union = 2.0 + 8.0 + 1.0 + 1.5
    assert sum(t for t, _ in got.values()) == pytest.approx(union)
    assert gp.busy_us(spans) == (pytest.approx(union), 4)


def test_a_kernel_inside_another_adds_nothing():
    gp = _module()
    got = gp.exclusive_us([("long", 0.0, 10.0), ("short", 2.0, 3.0)])
    assert got == {"long": (10.0, 1), "short": (0.0, 1)}
    assert gp.busy_us([("long", 0.0, 10.0), ("short", 2.0, 3.0), ("late", 12.0, 13.0)]) == (11.0, 3)


def test_between_steps_is_the_gpu_s_wait_over_the_steps():
    gp = _module()
    line = gp.between_steps([1000.0, 1000.0, 1000.0], [20.0, 40.0])
    assert "in a graph p50 1000 µs" in line and "between graphs p50 30 / mean 30" in line
    assert "idle 2% of the decode steps" in line  # 60 of 3060
