"""Quantized weights on the host, as loaders produce them: NumPy arrays in the contract's
canonical form (``fd_core.interfaces.QuantizedWeight``), and what the model needs to do with them
before they go to a device: dequantize, fuse (q/k/v, gate/up) and cut for tensor parallelism."""

from __future__ import annotations

from math import gcd
from typing import Any

import ml_dtypes
import numpy as np

from fd_core.errors import CheckpointError
from fd_core.interfaces import QuantizedWeight

HostWeight = np.ndarray | QuantizedWeight


def fp8_e4m3fn_values() -> np.ndarray:
    """The float32 value of each of the 256 float8 e4m3fn bit patterns (0x7F and 0xFF: NaN)."""
    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def group_of(weight: QuantizedWeight) -> int:
    """The number of input columns one scale covers."""
    return int(weight.qweight.shape[1]) if weight.group_size == -1 else weight.group_size


def upload_quantized(weight: QuantizedWeight, memory: Any) -> QuantizedWeight:
    """A host ``weight`` in the canonical form on ``memory``'s device (a ``Memory``): the
    integers as they are, scales and zeros in float32."""
    put = memory.from_numpy
    return QuantizedWeight(weight.method, put(np.ascontiguousarray(weight.qweight)),
                           put(np.ascontiguousarray(weight.scales), "float32"), weight.group_size,
                           tuple(weight.shape),
                           None if weight.zeros is None else put(np.ascontiguousarray(weight.zeros), "float32"))


def dequantize(weight: QuantizedWeight) -> np.ndarray:
    """The float32 ``[out, in]`` matrix a host QuantizedWeight (canonical layout) stands for."""
    if weight.layout:
        raise ValueError(f"only the canonical layout can be dequantized here, not {weight.layout!r}")
    if weight.method == "block_wise_fp8":
        w = fp8_e4m3fn_values()[np.asarray(weight.qweight).view(np.uint8)]
        block = weight.group_size
        scales = np.repeat(np.repeat(weight.scales.astype(np.float32), block, axis=0), block, axis=1)
        return w * scales[: w.shape[0], : w.shape[1]]
    if weight.method not in ("wint8", "wint4"):
        raise ValueError(f"unknown quantization method {weight.method!r}")
    group = group_of(weight)
    w = weight.qweight.astype(np.float32) * np.repeat(weight.scales.astype(np.float32), group, axis=1)
    if weight.zeros is not None:
        w += np.repeat(weight.zeros.astype(np.float32), group, axis=1)
    return w


def as_float(weight: HostWeight) -> np.ndarray:
    return dequantize(weight) if isinstance(weight, QuantizedWeight) else weight


def _regroup(weight: QuantizedWeight, method: str, group: int) -> QuantizedWeight:
    """The same values as ``method`` with a smaller group (wint4 values are wint8 values, and a
    group's scale repeated over its parts is the same scale): exact."""
    repeat = group_of(weight) // group
    zeros = weight.zeros if weight.zeros is not None else np.zeros_like(weight.scales)
    return QuantizedWeight(method, weight.qweight, np.repeat(weight.scales, repeat, axis=1), group,
                           weight.shape, np.repeat(zeros, repeat, axis=1))


def concat_rows(parts: list[HostWeight]) -> HostWeight:
    """Stack ``[out_i, in]`` weights into one (fused q/k/v, gate/up). Quantized parts of different
    kinds (a GGUF mixing Q4_K and Q6_K in one layer) meet in the widest of their forms, exactly;
    a mix of quantized and plain parts, or of fp8 and integers, is dequantized."""
    families = {"float" if not isinstance(p, QuantizedWeight) else "fp8" if p.method == "block_wise_fp8"
                else "int" for p in parts}
    if families == {"float"}:
        return np.concatenate(parts)
    if len(families) > 1:
        return np.concatenate([as_float(p) for p in parts])
    first = parts[0]
    if first.method == "block_wise_fp8":
        if any(p.shape[0] % first.group_size for p in parts[:-1]):
            return np.concatenate([as_float(p) for p in parts])  # a block would straddle two parts
        return QuantizedWeight(first.method, np.concatenate([p.qweight for p in parts]),
                               np.concatenate([p.scales for p in parts]), first.group_size,
                               (sum(p.shape[0] for p in parts), first.shape[1]))
    methods = {p.method for p in parts}
    method = "wint8" if "wint8" in methods else "wint4"
    group = 0
    for p in parts:
        group = gcd(group, group_of(p))
    same = all(p.method == method and group_of(p) == group for p in parts)
    has_zeros = {p.zeros is not None for p in parts}
    if not same or len(has_zeros) > 1:
        parts = [_regroup(p, method, group) for p in parts]
    zeros = None if parts[0].zeros is None else np.concatenate([p.zeros for p in parts])
    return QuantizedWeight(method, np.concatenate([p.qweight for p in parts]),
                           np.concatenate([p.scales for p in parts]), parts[0].group_size,
                           (sum(p.shape[0] for p in parts), first.shape[1]), zeros)


def take(weight: HostWeight, axis: int, start: int, stop: int, name: str) -> HostWeight:
    """Rows (``axis=0``) or input columns (``axis=1``) ``start:stop`` of a weight: one rank's part
    under tensor parallelism. Columns of a quantized weight must not split a group."""
    if not isinstance(weight, QuantizedWeight):
        return weight[start:stop] if axis == 0 else weight[:, start:stop]
    if axis == 0:
        if weight.method == "block_wise_fp8" and start % weight.group_size:
            raise CheckpointError(f"{name}: rows {start}:{stop} split a {weight.group_size}-row fp8 block; "
                                  f"choose a tensor-parallel size that divides the blocks")
        block = weight.group_size if weight.method == "block_wise_fp8" else 1
        sl = slice(start // block, -(-stop // block))
        return QuantizedWeight(weight.method, weight.qweight[start:stop], weight.scales[sl], weight.group_size,
                               (stop - start, weight.shape[1]),
                               None if weight.zeros is None else weight.zeros[start:stop])
    if weight.group_size == -1:  # one scale per row whatever the columns
        return QuantizedWeight(weight.method, weight.qweight[:, start:stop], weight.scales, -1,
                               (weight.shape[0], stop - start), weight.zeros)
    group = weight.group_size
    if start % group or (stop - start) % group and stop != weight.shape[1]:
        raise CheckpointError(f"{name}: input columns {start}:{stop} split a quantization group of {group}; "
                              f"choose a tensor-parallel size whose share of the columns is a multiple of it")
    sl = slice(start // group, -(-stop // group))
    return QuantizedWeight(weight.method, weight.qweight[:, start:stop], weight.scales[:, sl],
                           weight.group_size, (weight.shape[0], stop - start),
                           None if weight.zeros is None else weight.zeros[:, sl])


def permute_rows(weight: HostWeight, order: np.ndarray) -> HostWeight:
    """Rows in a new order (GGUF Llama's q/k rotary rows), scales and zeros with them."""
    if not isinstance(weight, QuantizedWeight):
        return weight[order]
    if weight.method == "block_wise_fp8":
        raise CheckpointError("fp8 block-quantized rows cannot be reordered")
    return QuantizedWeight(weight.method, weight.qweight[order], weight.scales[order], weight.group_size,
                           weight.shape, None if weight.zeros is None else weight.zeros[order])
