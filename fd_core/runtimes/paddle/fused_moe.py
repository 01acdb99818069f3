"""The ``moe`` op on the MoE dispatch and combine kernels Paddle device builds ship.

``paddle.incubate.nn.functional.moe_gate_dispatch`` sorts a batch's (token, expert) pairs by
expert and copies each token's row into its experts' slots of a padded ``[E * capacity, H]``
buffer; ``moe_combine`` sums each token's expert outputs with its routing weights. Both are
registered for GPU (paddle/phi/kernels/gpu/moe_gate_dispatch_kernel.cu, moe_combine_kernel.cu)
and XPU (paddle/phi/kernels/xpu/...); CPU Paddle has neither, so in emulation the probe declines
and the reference runs. What the adapter relies on, as read in those files:

- dispatch takes ``gate_logits`` as probabilities (it applies no softmax), picks each row's
  ``k`` largest, and returns ``scatter_index`` as ``[k, s]``: the row of ``y`` holding token
  ``s``'s ``j``-th choice, ``expert * capacity + its rank among that expert's pairs``;
- the XPU kernel takes ``use_pad=True`` only and no correction bias;
- combine reads ``scatter_index`` as ``[s, k]`` and its weights in ``x``'s dtype.

So the router is the contract's own (``ops.route``: softmax or sigmoid, correction bias, ties
to the lower id, renormalisation) and the kernel is handed scores that force exactly those
choices in that order (``k - j`` for the ``j``-th choice, 0 elsewhere); it only moves rows.
Capacity is the batch's largest per-expert count, read on the host as the reference does, so no
pair is dropped. The experts' products run on each expert's contiguous rows of ``y`` (no
gather), in float32 like the reference; under expert parallelism only this rank's experts run
and the other pairs get weight 0. The padded buffer holds ``E * capacity`` rows, so a batch is
split into pieces whose buffer stays near :data:`DISPATCH_BYTES`.
"""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF

from fd_core.interfaces import QuantizedWeight
from fd_core.runtimes.paddle import ops as reference
from fd_core.runtimes.paddle.ops import _f32, _f32_weight, _to, _upload

Tensor = paddle.Tensor

# About how large one piece's padded dispatch buffer may grow (float32 rows).
DISPATCH_BYTES = 256 << 20


def moe(
    x: Tensor,
    router_weight: Tensor,
    gate_up: list[Tensor | QuantizedWeight],
    down: list[Tensor | QuantizedWeight],
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: Tensor | None = None,
    expert_offset: int = 0,
) -> Tensor:
    n, hidden = x.shape
    num_experts = router_weight.shape[0]
    if n == 0:
        return paddle.zeros_like(x)
    ids, weights = reference.route(x, router_weight, top_k, scoring, renormalize, correction_bias)
    ids_host = ids.numpy()
    h = _f32(x)
    local = range(expert_offset, expert_offset + len(gate_up))
    pieces = []
    for lo, hi in _pieces(ids_host, num_experts, hidden):
        pieces.append(_dispatch_and_combine(h[lo:hi], ids[lo:hi], ids_host[lo:hi], weights[lo:hi], num_experts,
                                            gate_up, down, local))
    out = pieces[0] if len(pieces) == 1 else paddle.concat(pieces, axis=0)
    return _to(out, x.dtype)


def _pieces(ids: np.ndarray, num_experts: int, hidden: int) -> list[tuple[int, int]]:
    """Token ranges whose padded buffers (``E * capacity * H`` float32) stay near the budget."""
    n = len(ids)
    capacity = int(np.bincount(ids.reshape(-1), minlength=num_experts).max())
    count = max(1, math.ceil(num_experts * capacity * hidden * 4 / DISPATCH_BYTES))
    count = min(count, n)
    bounds = np.linspace(0, n, count + 1).astype(int)
    return [(int(a), int(b)) for a, b in pairwise(bounds) if b > a]


def _dispatch_and_combine(
    h: Tensor, ids: Tensor, ids_host: np.ndarray, weights: Tensor, num_experts: int,
    gate_up: list[Tensor | QuantizedWeight], down: list[Tensor | QuantizedWeight], local: range,
) -> Tensor:
    n, top_k = ids_host.shape
    counts = np.bincount(ids_host.reshape(-1), minlength=num_experts)
    capacity = int(counts.max())
    # scores that make the kernel's top-k pick this router's choices, best first
    rank = paddle.arange(top_k, 0, -1, dtype="float32").expand([n, top_k])
    forced = paddle.put_along_axis(paddle.zeros([n, num_experts], dtype="float32"), ids, rank, axis=1)
    y, _, scatter_index, _, _ = IF.moe_gate_dispatch(h, forced, None, top_k, capacity, True)
    outputs, start, total = [], np.zeros(num_experts, np.int64), 0  # start: an expert's first compact row
    for e in local:
        if counts[e]:
            start[e], total = total, total + int(counts[e])
            rows = y[e * capacity : e * capacity + int(counts[e])]
            hidden = reference.linear(rows, _f32_weight(gate_up[e - local.start]))
            outputs.append(reference.linear(reference.silu_and_mul(hidden), _f32_weight(down[e - local.start])))
    if not outputs:  # no token of this piece chose an expert of this rank
        return paddle.zeros_like(h)
    is_local = _upload(((ids_host >= local.start) & (ids_host < local.stop)), h.place)
    # the compact row of each pair: its expert's first row plus its rank within the expert
    slot = paddle.transpose(scatter_index, [1, 0]).astype("int64")
    compact = paddle.gather(_upload(start, h.place), ids.reshape([-1])).reshape(ids.shape) + slot - ids * capacity
    index = paddle.where(is_local, compact, paddle.zeros_like(compact)).astype("int32")
    weight = paddle.where(is_local, _f32(weights), paddle.zeros_like(_f32(weights)))
    return IF.moe_combine(paddle.concat(outputs, axis=0), weight, index)
