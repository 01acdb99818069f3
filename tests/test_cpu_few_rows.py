"""The CPU backend's plain ``linear`` for a few rows of a large weight (few_rows.py): the product
taken weight-major on both runtimes, the reference's result within float rounding, and the
reference wherever the rule does not apply."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.backends.cpu import few_rows
from fd_core.plugins import get_registry

OUT, IN = 16384, 576  # 36 MiB of float32: above MIN_BYTES


def _runtime(name: str):
    """``(to_tensor, to_numpy, linear, reference module path)`` of a runtime."""
    if name == "torch":
        torch = pytest.importorskip("torch")
        return (torch.from_numpy, lambda t: t.numpy(), few_rows.linear_torch, "fd_core.runtimes.torch.ops")
    paddle = pytest.importorskip("paddle")
    return (paddle.to_tensor, lambda t: t.numpy(), few_rows.linear_paddle, "fd_core.runtimes.paddle.ops")


def test_the_rule(monkeypatch):
    monkeypatch.setattr(few_rows, "one_row", lambda: True)
    assert few_rows.weight_major(1, OUT, IN, True) and few_rows.weight_major(few_rows.WIDE_ROWS, OUT, IN, True)
    assert not few_rows.weight_major(few_rows.WIDE_ROWS + 1, OUT, IN, True)
    # a weight without many more outputs than inputs: only up to ROWS rows
    assert few_rows.weight_major(few_rows.ROWS, 4096, 4096, True)
    assert not few_rows.weight_major(few_rows.ROWS + 1, 4096, 4096, True)
    assert not few_rows.weight_major(1, 1536, 576, True)  # fits the caches: x @ w.T is as fast
    assert not few_rows.weight_major(1, OUT, IN, False)  # 16-bit dtypes: not measured
    assert not few_rows.weight_major(0, OUT, IN, True)
    # a CPU without AVX-512: one row stays x @ w.T, two and more go weight-major as before
    monkeypatch.setattr(few_rows, "one_row", lambda: False)
    assert not few_rows.weight_major(1, OUT, IN, True) and few_rows.weight_major(2, OUT, IN, True)


def test_one_row_follows_the_cpu(monkeypatch):
    """One row is taken weight-major only where the CPU's flags name AVX-512 (measured to gain
    there, to lose on an AVX2-only CPU); no flags at all (not Linux): not."""
    for flags, want in ((frozenset({"avx2", "avx512f", "fma"}), True), (frozenset({"avx2", "fma"}), False),
                        (None, False)):
        monkeypatch.setattr(few_rows, "cpu_flags", lambda flags=flags: flags)
        few_rows.one_row.cache_clear()
        assert few_rows.one_row() is want
    few_rows.one_row.cache_clear()


@pytest.mark.parametrize("runtime", ["torch", "paddle"])
def test_few_rows_give_the_product_without_the_reference(runtime, monkeypatch):
    import importlib

    tensor, host, linear, reference_module = _runtime(runtime)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((OUT, IN)) * 0.05).astype(np.float32)
    b = rng.standard_normal(OUT).astype(np.float32)
    reference = importlib.import_module(reference_module)
    calls = []
    real = reference.linear
    monkeypatch.setattr(reference, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(few_rows, "one_row", lambda: True)  # one row padded to two, whatever this CPU
    for shape in [(1, IN), (2, IN), (4, IN), (7, IN), (10, IN), (1, 1, IN), (11, IN)]:
        x = rng.standard_normal(shape).astype(np.float32)
        want = x.astype(np.float64) @ w.T.astype(np.float64) + b
        for bias in (None, b):
            got = host(linear(tensor(x), tensor(w), None if bias is None else tensor(bias)))
            assert got.shape == shape[:-1] + (OUT,) and got.dtype == np.float32
            np.testing.assert_allclose(got, want if bias is not None else want - b, rtol=0, atol=2e-5)
    # only the eleven-row product went to the reference (twice: with and without the bias)
    assert [tuple(s) for s in calls] == [(11, IN), (11, IN)]
    monkeypatch.setattr(few_rows, "one_row", lambda: False)  # an AVX2-only CPU: one row to the reference
    calls.clear()
    x = rng.standard_normal((1, IN)).astype(np.float32)
    np.testing.assert_allclose(host(linear(tensor(x), tensor(w))), x.astype(np.float64) @ w.T.astype(np.float64),
                               rtol=0, atol=2e-5)
    assert [tuple(s) for s in calls] == [(1, IN)]


@pytest.mark.parametrize("runtime", ["torch", "paddle"])
def test_the_cpu_op_table_takes_few_rows_for_plain_weights(runtime):
    if runtime == "torch":
        pytest.importorskip("torch")
    registry = get_registry()
    table = registry.op_table(registry.platform("cpu", runtime), {"dtype": "float32", "quantization": None},
                              methods=["wint4"] if runtime == "torch" else [])
    choice = table.choices["linear"]
    assert choice.impl.name == "few-rows" and choice.impl.source == "fd-core" and choice.impl.runtime == runtime
    if runtime == "torch":  # quantized weights keep torch's packed kernels
        assert table.per_method["wint4"]["linear"].impl.name == "torch-packed"
