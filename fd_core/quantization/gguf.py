"""GGUF's quantized block types kept quantized: each maps exactly onto the contract's wint8/wint4.

The raw rows of a tensor (``[rows, bytes per row]`` uint8, as ``gguf.GGUFReader`` exposes them)
are decoded block by block with NumPy, never through a float32 copy of the weight:

- ``Q8_0``: 32 values ``d * q`` (q int8) -> wint8, group 32.
- ``Q4_0``: 32 values ``d * (q - 8)`` (q 4-bit) -> wint4, group 32.
- ``Q4_1``: 32 values ``d * q + m`` -> wint4, group 32, zero ``m + 8 d`` (q stored as ``q - 8``).
- ``Q4_K``: 256-value super-blocks of eight 32-value groups, ``d * sc * q - dmin * mn`` with 6-bit
  ``sc``, ``mn`` -> wint4, group 32, zero ``8 d sc - dmin mn``.
- ``Q6_K``: 256-value super-blocks of sixteen 16-value groups, ``d * sc * q`` with q 6-bit in
  ``[-32, 31]`` and ``sc`` int8 -> wint8, group 16.

Scales and zeros are float32 products of the format's float16 factors and small integers, so they
are exact; the only rounding is the zero of Q4_1/Q4_K (one float32 addition), within float
rounding of the value the format defines. Byte layouts follow ggml's ``dequantize_row_*``.
"""

from __future__ import annotations

import numpy as np

from fd_core.interfaces import QuantizedWeight

# type name -> (values per block, bytes per block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
KEPT = frozenset(BLOCKS)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from ``[..., 2]`` bytes, as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value 4-bit block: byte j holds value j (low nibble) and j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def decode(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """``raw``: the tensor's bytes, ``[rows, bytes per row]``; ``shape``: ``(rows, columns)``."""
    rows, cols = shape
    per_block, nbytes = BLOCKS[type_name]
    if cols % per_block:
        raise ValueError(f"{type_name} rows hold whole blocks of {per_block}, not {cols} values")
    blocks = np.asarray(raw, dtype=np.uint8).reshape(rows, cols // per_block, nbytes)
    zeros = None
    if type_name == "Q8_0":
        scales = _f16(blocks[..., 0:2])
        q = blocks[..., 2:].view(np.int8)
        method, group = "wint8", 32
    elif type_name in ("Q4_0", "Q4_1"):
        scales = _f16(blocks[..., 0:2])
        start = 2 if type_name == "Q4_0" else 4
        q = _nibbles(blocks[..., start:]).astype(np.int8) - 8
        if type_name == "Q4_1":
            zeros = _f16(blocks[..., 2:4]) + 8 * scales
        method, group = "wint4", 32
    elif type_name == "Q4_K":
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        qs = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: groups 2c and 2c+1
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).astype(np.int8) - 8  # [r, b, chunk, half, 32]
        scales = (d * sc).reshape(rows, -1)
        zeros = (8 * d * sc - dmin * mn).reshape(rows, -1)
        method, group = "wint4", 32
    elif type_name == "Q6_K":
        ql, qh = blocks[..., 0:128], blocks[..., 128:192]
        sc = blocks[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[..., 208:210])[..., None]
        q = _q6k_values(ql, qh)
        scales = (d * sc).reshape(rows, -1)
        method, group = "wint8", 16
    else:
        raise ValueError(f"GGUF type {type_name} is not kept quantized")
    return QuantizedWeight(method, np.ascontiguousarray(q.reshape(rows, cols)),
                           np.ascontiguousarray(scales.reshape(rows, -1), dtype=np.float32), group, (rows, cols),
                           None if zeros is None else np.ascontiguousarray(zeros.reshape(rows, -1), dtype=np.float32))


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins of a Q4_K super-block from its 12 packed bytes."""
    p = packed.astype(np.uint16)
    low_sc, low_mn = p[..., 0:4] & 63, p[..., 4:8] & 63
    high_sc = (p[..., 8:12] & 0x0F) | ((p[..., 0:4] >> 6) << 4)
    high_mn = (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)
    sc = np.concatenate([low_sc, high_sc], axis=-1).astype(np.float32)
    mn = np.concatenate([low_mn, high_mn], axis=-1).astype(np.float32)
    return sc, mn


def _q6k_values(ql: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """The 256 signed 6-bit values of each Q6_K super-block, in order."""
    halves = []
    for h in range(2):  # each half: 64 bytes of low bits, 32 of high bits, 128 values
        lo, hi = ql[..., 64 * h: 64 * h + 64].astype(np.int16), qh[..., 32 * h: 32 * h + 32].astype(np.int16)
        halves += [
            (lo[..., :32] & 0x0F) | ((hi & 3) << 4),
            (lo[..., 32:] & 0x0F) | (((hi >> 2) & 3) << 4),
            (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4),
            (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4),
        ]
    return (np.concatenate(halves, axis=-1) - 32).astype(np.int8)
