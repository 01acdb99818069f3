"""Rotary tables, built once on the host in NumPy and handed to the device as a constant."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fd_core.errors import UnsupportedArchitectureError


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse frequencies (length ``rotary_dim // 2``), with the scalings Llama-family
    checkpoints use. Computed in float64, returned as float32 like the reference does."""
    inv = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv.astype(np.float32)
    if kind == "linear":
        return (inv / float(scaling["factor"])).astype(np.float32)  # type: ignore[index]
    if kind == "llama3":
        assert scaling is not None
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return np.where(is_mid, mid, scaled).astype(np.float32)
    raise UnsupportedArchitectureError(f"rope scaling type {kind!r} is not supported")


def cos_sin_table(rotary_dim: int, max_positions: int, theta: float,
                  scaling: dict[str, Any] | None = None) -> np.ndarray:
    """``[max_positions, rotary_dim]``: cos of every angle, then sin, as the rotary op expects."""
    inv = inv_frequencies(rotary_dim, theta, scaling)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
