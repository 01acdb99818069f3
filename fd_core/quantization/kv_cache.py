"""The quantized KV cache's format (``--kv-cache-dtype int8 | fp8_e4m3``), on the host (NumPy):
what the specification writes and reads. Runtimes implement the same format with their own ops.

A quantized cache keeps the contract's ``[slots, Hk, row]`` layout, one row per (slot, kv head):
the head's ``D`` values, then the row's scale as float16 (2 bytes, little-endian). The tensor's
dtype names the format: int8 holds int8 values, uint8 float8 e4m3fn bit patterns. The scale maps the row's largest magnitude to
the format's largest value (127 or 448), so each row keeps its own range (scales per head and
token, nothing to calibrate). ``D + 2`` bytes against ``2 D`` for bfloat16: 1.94x the blocks at
``D = 64``, 1.97x at 128.
"""

from __future__ import annotations

import numpy as np

from fd_core.quantization.host import fp8_e4m3fn_values
from fd_core.quantization.quantize import FP8_MAX, e4m3_bits

KV_QUANTIZED = {"int8": 127.0, "fp8_e4m3": FP8_MAX}  # dtype -> the largest value a row maps to
SCALE_BYTES = 2


def row_bytes(dtype: str, head_dim: int) -> int:
    """Bytes of one (slot, head) row of a cache in ``dtype``."""
    if dtype in KV_QUANTIZED:
        return head_dim + SCALE_BYTES
    return head_dim * {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


STORAGE = {"int8": np.int8, "fp8_e4m3": np.uint8}  # the cache tensor's dtype for each format
STORAGE_FORMAT = {np.dtype(v).name: k for k, v in STORAGE.items()}  # "int8" / "uint8" -> the format


def cache_layout(dtype: str, head_dim: int) -> tuple[int, str]:
    """``(row length, tensor dtype)`` of a KV cache kept in ``dtype`` (a Memory's allocation)."""
    if dtype in KV_QUANTIZED:
        return head_dim + SCALE_BYTES, np.dtype(STORAGE[dtype]).name
    return head_dim, dtype


def quantize_rows(x: np.ndarray, dtype: str) -> np.ndarray:
    """``[..., D]`` float rows as ``[..., D + 2]`` cache rows (int8 or uint8, see ``STORAGE``)."""
    x = np.asarray(x, dtype=np.float32)
    top = KV_QUANTIZED[dtype]
    scale = (np.abs(x).max(axis=-1, keepdims=True) / top).astype(np.float16)
    safe = np.where(scale == 0, np.float16(1), scale).astype(np.float32)
    if dtype == "int8":
        values = np.clip(np.rint(x / safe), -127, 127).astype(np.int8).view(np.uint8)
    else:
        values = e4m3_bits(x / safe)
    out = np.concatenate([values, scale.view(np.uint8).reshape(*scale.shape[:-1], SCALE_BYTES)], axis=-1)
    return out.view(STORAGE[dtype])


def dequantize_rows(rows: np.ndarray) -> np.ndarray:
    """``[..., D + 2]`` cache rows (the format from their dtype) as ``[..., D]`` float32."""
    raw = np.ascontiguousarray(rows).view(np.uint8)
    scale = raw[..., -SCALE_BYTES:].copy().view(np.float16).astype(np.float32)
    values = raw[..., :-SCALE_BYTES]
    if rows.dtype == np.int8:
        decoded = values.view(np.int8).astype(np.float32)
    else:
        decoded = fp8_e4m3fn_values()[values]
    return decoded * scale


def format_of(cache_dtype: np.dtype) -> str | None:
    """The quantized format a cache of this dtype holds, None for a float cache."""
    return {np.dtype(np.int8): "int8", np.dtype(np.uint8): "fp8_e4m3"}.get(np.dtype(cache_dtype))
