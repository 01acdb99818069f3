"""The ``moe`` adapter over Paddle's MoE dispatch and combine kernels
(fd_core.runtimes.paddle.fused_moe). CPU Paddle has neither kernel, so the adapter is held to
the spec through stand-ins written from the GPU kernels' definitions and the XPU kernel's
limits; on the CPU place the real probe declines and the reference serves ``moe``."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core.interfaces import Capabilities
from fd_core.plugins import OpRegistry
from fd_core.plugins.ops import op_context
from fd_core.runtimes.paddle import REFERENCE_OPS, fused, fused_moe
from fd_core.runtimes.paddle.memory import PaddleMemory
from fd_core.testing import opcases


def moe_gate_dispatch(x, gate_logits, corr_bias, k, capacity, use_pad):
    """A stand-in for the kernel, from paddle/phi/kernels/gpu/moe_gate_dispatch_kernel.cu and
    moe_fuse_op.h: each row's k largest ``gate_logits`` (taken as probabilities; ties to the lower
    id), the pairs sorted by expert keeping row order, pair (s, j) copied to row ``e * capacity
    + r`` of ``y`` (r: its rank within expert e; pairs past the capacity dropped: index 0,
    weight 0), ``scatter_index`` ``[k, s]``, ``expert_offset`` the inclusive count per expert.
    Rows no pair fills hold NaN (the kernel leaves them unwritten). Refuses what the XPU kernel
    refuses (paddle/phi/kernels/xpu/moe_gate_dispatch_kernel.cc): use_pad=False, a correction
    bias."""
    if not use_pad or corr_bias is not None:
        raise RuntimeError("the XPU kernel takes use_pad=True and no corr_bias only")
    assert gate_logits.dtype == paddle.float32 and capacity > 0
    xs, probs = x.numpy(), gate_logits.numpy()
    s, e = probs.shape
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, ids, axis=1).astype(np.float32)
    order = np.argsort(ids.reshape(-1), kind="stable")  # pairs row * k + j, sorted by expert
    y = np.full((e * capacity, xs.shape[1]), np.nan, xs.dtype)
    scatter = np.zeros((k, s), np.int32)
    seen = np.zeros(e, np.int64)
    for pair in order:
        row, j = divmod(int(pair), k)
        expert = ids[row, j]
        r = seen[expert]
        seen[expert] += 1
        if r >= capacity:
            weights[row, j] = 0.0
            continue
        y[expert * capacity + r] = xs[row]
        scatter[j, row] = expert * capacity + r
    offsets = np.cumsum(np.bincount(ids.reshape(-1), minlength=e)).astype(np.int64)
    return (paddle.to_tensor(y), paddle.to_tensor(weights), paddle.to_tensor(scatter),
            paddle.to_tensor(offsets), paddle.to_tensor(ids.astype(np.int32)))


def moe_combine(x, combine_weights, scatter_index):
    """From paddle/phi/kernels/gpu/moe_combine_kernel.cu: out[s] = sum_j w[s, j] * x[index[s, j]]
    with ``scatter_index`` read as ``[s, k]`` int32 and the weights in ``x``'s dtype."""
    assert scatter_index.dtype == paddle.int32 and combine_weights.dtype == x.dtype
    xs, w, index = x.numpy(), combine_weights.numpy(), scatter_index.numpy()
    assert index.shape == w.shape and index.min() >= 0 and index.max() < len(xs)
    return paddle.to_tensor(np.einsum("sk,skh->sh", w, xs[index]).astype(xs.dtype))


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.setattr(fused_moe.IF, "moe_gate_dispatch", moe_gate_dispatch)
    monkeypatch.setattr(fused_moe.IF, "moe_combine", moe_combine)


CAPS = Capabilities(dtypes=frozenset({"float32"}),
                    quantization=frozenset({"wint8", "wint4", "block_wise_fp8"}))
MOE_CASES = opcases.cases(CAPS, {"moe"})


@pytest.mark.parametrize("case", MOE_CASES, ids=[c.id for c in MOE_CASES])
def test_the_kit_moe_cases_through_the_kernels(kernels, case):
    """softmax and sigmoid routing, correction bias, top-1..8, quantized experts, expert
    parallelism with tokens that choose no local expert: against the NumPy spec."""
    opcases.run_case(case, fused_moe.moe, PaddleMemory("cpu"), "moe_gate_dispatch")


def test_a_batch_split_into_pieces_gives_the_same_output(kernels, monkeypatch):
    case = next(c for c in MOE_CASES if c.label.startswith("x[150, 64]"))
    dispatched = []
    monkeypatch.setattr(fused_moe.IF, "moe_gate_dispatch", lambda *a: dispatched.append(a[0].shape[0]) or
                        moe_gate_dispatch(*a))
    monkeypatch.setattr(fused_moe, "DISPATCH_BYTES", 8 * 64 * 4 * 12)  # ~12 rows an expert
    opcases.run_case(case, fused_moe.moe, PaddleMemory("cpu"), "moe_gate_dispatch")
    assert len(dispatched) > 3 and sum(dispatched) == 150


def test_no_tokens(kernels):
    x = paddle.zeros([0, 8])
    out = fused_moe.moe(x, paddle.ones([4, 8]), [paddle.ones([6, 8])] * 4, [paddle.ones([8, 3])] * 4, 2)
    assert out.shape == [0, 8]


def test_the_probe_accepts_the_kernels_and_declines_a_wrong_layout(kernels, monkeypatch):
    assert fused._check("moe", "cpu", "float32") == (True, "")

    def combine_reading_k_by_s(x, w, index):  # a combine that takes the index as dispatch made it
        return moe_combine(x, w, paddle.transpose(index, [1, 0]).reshape(index.shape))

    monkeypatch.setattr(fused_moe.IF, "moe_combine", combine_reading_k_by_s)
    ok, why = fused._check("moe", "cpu", "float32")
    assert not ok and "Not equal to tolerance" in why


def test_on_the_cpu_place_the_probe_declines_and_the_reference_serves_moe():
    ok, why = fused.probe("moe", "cpu")
    assert not ok and "moe_gate_dispatch" in why and "not registered" in why
    registry = OpRegistry()
    fused.register_fused(registry, "chip", lambda: "cpu")
    registry.use_reference("chip", "paddle")
    registry.register_reference("paddle", REFERENCE_OPS)
    table = registry.select("chip", "paddle", op_context("float32", 64))
    assert table.choices["moe"].impl.name == "reference"
    assert "moe_gate_dispatch" in table.choices["moe"].reason and "not registered" in table.choices["moe"].reason
