"""Plain (unquantized) ``linear`` on the CPU for a few rows of a large weight, on either runtime:
the product taken weight-major, ``(w @ x.T).T``, instead of ``x @ w.T``.

Why: under both torch and Paddle the CPU matmul (MKL) computes ``x @ w.T`` for a few rows of
``x`` badly. One row goes through a matrix-vector product that reads the weight at about a third
of the bandwidth two cores get, and two to four rows take longer still, as if each row were a
pass over the weight. Taken weight-major, the same product streams the weight once. Development
machine (AMD EPYC, 2 cores, AVX-512; torch 2.13.0, Paddle 3.3.1), float32, ms a call:

============================  ====================  ====================
weight                        rows 1 / 2 / 4 as now  weight-major
============================  ====================  ====================
SmolLM2's LM head 49152x576   7.1 / 17.5 / 13.8      3.3 / 3.0 / 3.3 (torch)
the same, Paddle              7.3 / 14.6 / 28.7      4.5 / 4.5 / 5.1
16384x576 (36 MiB)            2.3 / 4.5 / 3.1        0.8 / 0.8 / 1.0
4096x4096 (64 MiB)            2.8 / 5.7 / 5.7        2.4 / 2.4 / 4.4
2048x2048 (16 MiB)            0.25 / 0.53 / 1.0      0.30 / 0.31 / 0.41
============================  ====================  ====================

A weight with many more outputs than inputs (a vocabulary's LM head) keeps winning up to 10
rows: the head 12.8 / 16.6 / 12.7 / 16.2 ms at 5 / 6 / 8 / 10 rows against 3.9 / 5.1 / 6.1 / 8.2;
32768x1024 18.6 / 16.8 / 16.5 / 21.2 against 5.6 / 6.9 / 11.1 / 15.2. From 12 rows on the two
orders are level or ``x @ w.T`` wins. So do square weights at 8 rows (4096x4096: 5.0 against
5.8 ms) and one row of a weight that fits the caches. Hence ``ROWS``, ``WIDE_ROWS`` and
``MIN_BYTES``. One row is padded to two: a weight-major product with a single column goes back
to the slow matrix-vector path. Float32 only (the other dtypes run other kernels, not
measured). The sums are the same products added in another order: float rounding apart, the
result is the reference's. docs/PERFORMANCE.md has the model-level figures.

One row only where the CPU has AVX-512. On an AVX2-only machine (AMD EPYC, 2 cores, same
versions) one row of the head took 13.1-16.5 ms as ``x @ w.T`` against 18.3-19.5 padded
weight-major, on both runtimes, while two to four rows still gained: 31.0 / 35.2 -> 17.9 / 16.8
ms (torch), 34.5-37.8 / 65.0-66.6 -> 16.7-20.4 / 15.4-18.6 (Paddle). There MKL's one-row path
reads the weight as fast as the weight-major product does, and the padding's second column
costs. ``one_row`` decides from the CPU's flags, once a process.
"""

from __future__ import annotations

import functools
from typing import Any

from fd_core.host import cpu_flags
from fd_core.interfaces import QuantizedWeight

ROWS = 4  # at most this many rows of x
WIDE, WIDE_ROWS = 16, 10  # a weight with WIDE times more outputs than inputs: up to WIDE_ROWS rows
MIN_BYTES = 32 << 20  # a weight at least this large (float32 bytes)


@functools.cache
def one_row() -> bool:
    """Whether one row is taken weight-major (padded to two) on this CPU: where it has AVX-512,
    the only kind of CPU that was measured to gain (the module's doc)."""
    flags = cpu_flags()
    return flags is not None and "avx512f" in flags


def weight_major(rows: int, out_features: int, in_features: int, float32: bool) -> bool:
    """Whether a product of ``rows`` rows with an ``[out, in]`` weight is taken weight-major."""
    if not float32 or rows < 1 or out_features * in_features * 4 < MIN_BYTES or (rows == 1 and not one_row()):
        return False
    return rows <= (WIDE_ROWS if out_features >= WIDE * in_features else ROWS)


def linear_torch(x: Any, weight: Any, bias: Any = None) -> Any:
    import torch

    from fd_core.runtimes.torch.ops import linear as reference

    if isinstance(weight, QuantizedWeight) or weight.dim() != 2:
        return reference(x, weight, bias)
    out_features, in_features = weight.shape
    x2 = x.reshape(-1, in_features)
    rows = x2.shape[0]
    if not weight_major(rows, out_features, in_features, x.dtype == weight.dtype == torch.float32):
        return reference(x, weight, bias)
    if rows == 1:
        x2 = torch.cat([x2, x2])
    y = torch.mm(weight, x2.t())[:, :rows].t().contiguous()
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], out_features)


def linear_paddle(x: Any, weight: Any, bias: Any = None) -> Any:
    import paddle

    from fd_core.runtimes.paddle.ops import linear as reference

    if isinstance(weight, QuantizedWeight) or len(weight.shape) != 2:
        return reference(x, weight, bias)
    out_features, in_features = weight.shape
    x2 = x.reshape([-1, in_features])
    rows = x2.shape[0]
    if not weight_major(rows, out_features, in_features, x.dtype == weight.dtype == paddle.float32):
        return reference(x, weight, bias)
    if rows == 1:
        x2 = paddle.concat([x2, x2])
    y = paddle.matmul(weight, x2, transpose_y=True)[:, :rows].t()
    if bias is not None:
        y = y + bias
    return y.reshape([*x.shape[:-1], out_features])
