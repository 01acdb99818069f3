"""Quantizing float weights on the host (``--quantization``): the methods, their spellings and
default group sizes, and the quantizers that turn a ``[out, in]`` float matrix into the
contract's canonical ``QuantizedWeight``.

The model calls a :class:`LoadQuantization` on each decoder linear as the checkpoint yields it
(``DecoderForCausalLM.load_weights``), so the float matrix of one weight at a time is alive,
never the whole model in float.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import ml_dtypes
import numpy as np

from fd_core.errors import CheckpointError
from fd_core.host import usable_cpus
from fd_core.interfaces import FP8_BLOCK, QUANTIZATION_METHODS, QuantizedWeight
from fd_core.quantization.host import HostWeight, as_float

log = logging.getLogger("fd.quantization")

ALIASES = {"fp8": "block_wise_fp8"}  # vLLM's spelling
DEFAULT_GROUP_SIZE = {"wint8": -1, "wint4": 128, "block_wise_fp8": FP8_BLOCK}
FP8_MAX = 448.0  # the largest finite float8 e4m3fn
BAND_VALUES = 1 << 20  # values a quantizer takes at a time (by_row_bands)
THREADS = min(8, usable_cpus())
T = TypeVar("T")


def method_name(name: str) -> str:
    """The canonical method for a ``--quantization`` value; ValueError naming the accepted ones."""
    method = ALIASES.get(name, name)
    if method not in QUANTIZATION_METHODS:
        accepted = ", ".join(QUANTIZATION_METHODS) + ", " + ", ".join(f"{a} (= {m})" for a, m in ALIASES.items())
        raise ValueError(f"--quantization {name}: fd quantizes weights with {accepted}")
    return method


def check_group_size(method: str, group_size: int | None) -> int:
    """The group size ``method`` uses: ``group_size`` if given and allowed, else its default."""
    if group_size is None:
        return DEFAULT_GROUP_SIZE[method]
    if method == "block_wise_fp8":
        if group_size != FP8_BLOCK:
            raise ValueError(f"--quantization-group-size {group_size}: block_wise_fp8 uses "
                             f"{FP8_BLOCK}x{FP8_BLOCK} blocks")
        return group_size
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (group_size == -1 or group_size >= 2):
        raise ValueError(f"--quantization-group-size {group_size!r}: give the input columns one scale covers "
                         f"(an integer >= 2), or -1 for one scale per output channel")
    return group_size


def quantize(weight: np.ndarray, method: str, group_size: int, zeros: bool = False) -> QuantizedWeight:
    """``weight`` ``[out, in]`` in ``method``'s canonical form. wint8/wint4: round to nearest
    with one scale per group of ``group_size`` input columns (-1: per output channel), symmetric,
    or with ``zeros`` asymmetric (each group's range mapped onto all the levels, as GGUF's Q4_1
    does). block_wise_fp8: one scale per 128 x 128 block mapping its largest magnitude to 448."""
    w = np.asarray(weight, dtype=np.float32)
    if method == "block_wise_fp8":
        bits, scales = fp8_blocks(w, FP8_BLOCK, FP8_BLOCK)
        return QuantizedWeight("block_wise_fp8", bits, scales, FP8_BLOCK, w.shape)
    group = w.shape[1] if group_size == -1 else group_size
    parts = by_row_bands(lambda band: _levels(band, 127 if method == "wint8" else 7, group, zeros), w, 1)
    q, scales, zero = (None if parts[0][i] is None else np.concatenate([p[i] for p in parts]) for i in range(3))
    return QuantizedWeight(method, q, scales, group_size, w.shape, zero)


def _levels(w: np.ndarray, top: int, group: int, zeros: bool):
    """Rows ``w`` as ``(q int8, scales, zeros or None)``, each group's levels ``-top - 1 .. top``."""
    blocks = w.reshape(w.shape[0], w.shape[1] // group, group)
    if zeros:
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        scales = (high - low) / (2 * top + 1)
        zero = low + (top + 1) * scales  # the value of level 0
        q = np.clip(np.round((blocks - zero[..., None]) / _nonzero(scales)[..., None]), -top - 1, top)
        return q.astype(np.int8).reshape(w.shape), scales.astype(np.float32), zero.astype(np.float32)
    scales = np.abs(blocks).max(axis=-1) / top
    q = np.clip(np.round(blocks / _nonzero(scales)[..., None]), -top - 1, top).astype(np.int8)
    return q.reshape(w.shape), scales.astype(np.float32), None


def _nonzero(scales: np.ndarray) -> np.ndarray:
    return np.where(scales == 0, 1, scales)  # an all-zero group: q = 0 under any scale


def by_row_bands(fn: Callable[[np.ndarray], T], x: np.ndarray, align: int) -> list[T]:
    """``fn`` of each band of ``x``'s rows, in order: bands of a multiple of ``align`` rows and
    about ``BAND_VALUES`` values, so that a quantizer's passes stay in the CPU's caches (a
    14336 x 4096 matrix's FP8 rounding took 3-6 s whole, 0.5 s in bands), on up to
    ``THREADS`` threads (NumPy's passes and ml_dtypes' cast release the GIL: 2 cores, one
    28672 x 4096 cast 0.73 -> 0.40 s)."""
    band = align * max(1, BAND_VALUES // (align * max(1, x.shape[1])))
    starts = range(0, x.shape[0], band)
    if len(starts) <= 1:
        return [fn(x)]
    with ThreadPoolExecutor(min(THREADS, len(starts))) as pool:
        return list(pool.map(lambda top: fn(x[top : top + band]), starts))


def fp8_blocks(x: np.ndarray, block_rows: int, block_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """``x`` ``[rows, cols]`` in float8 e4m3fn with one float32 scale per ``block_rows x
    block_cols`` block (partial at the edges) mapping its largest magnitude to 448: ``(bits
    [rows, cols] uint8, scales [ceil(rows / block_rows), ceil(cols / block_cols)])``. The
    weights' 128 x 128 blocks (``block_wise_fp8``) and the activations' 1 x 128 groups of W8A8
    (``spec.fp8_activations``)."""
    x = np.asarray(x, dtype=np.float32)
    parts = by_row_bands(lambda band: _fp8_band(band, block_rows, block_cols), x, block_rows)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _fp8_band(x: np.ndarray, block_rows: int, block_cols: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = x.shape
    nr, nc = -(-rows // block_rows), -(-cols // block_cols)
    padded = np.zeros((nr * block_rows, nc * block_cols), np.float32)
    padded[:rows, :cols] = x
    blocks = padded.reshape(nr, block_rows, nc, block_cols)
    scales = np.maximum(blocks.max(axis=(1, 3)), -blocks.min(axis=(1, 3))) / np.float32(FP8_MAX)
    np.divide(blocks, _nonzero(scales)[:, None, :, None], out=blocks)
    return e4m3_bits(padded[:rows, :cols]), scales


def e4m3_bits(x: np.ndarray) -> np.ndarray:
    """The float8 e4m3fn bit patterns (uint8) nearest to ``x`` (ties to even), saturating at
    +-448: what ``torch.Tensor.to(torch.float8_e4m3fn)`` gives for finite inputs. ml_dtypes'
    cast rounds (NumPy has no float8 type); the clip saturates, where the cast gives NaN."""
    return np.clip(np.asarray(x, dtype=np.float32), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


@dataclass
class LoadQuantization:
    """``--quantization`` applied to a checkpoint as it streams in: each decoder linear the
    model hands over is quantized with ``method`` and ``group_size`` (wint4 with zero points);
    an already quantized weight (a GGUF's Q4_1, an FP8 checkpoint) is quantized again from its
    float values."""

    method: str
    group_size: int
    requantized: dict[str, int] = field(default_factory=dict)  # source method -> weights

    def __call__(self, name: str, weight: HostWeight) -> QuantizedWeight:
        in_features = int(weight.shape[1])
        if self.method != "block_wise_fp8" and self.group_size != -1 and in_features % self.group_size:
            fits = self.group_size
            while in_features % fits:
                fits //= 2
            raise CheckpointError(f"{name}: its {in_features} input features do not divide into {self.method} "
                                  f"groups of {self.group_size}; choose a --quantization-group-size that divides "
                                  f"{in_features}, such as {fits} (or -1, one scale per output channel)")
        if isinstance(weight, QuantizedWeight):
            if self.keeps(weight):
                return weight
            self.requantized[weight.method] = self.requantized.get(weight.method, 0) + 1
        # wint4 with zero points: each group's range mapped onto all 16 levels. Measured on
        # SmolLM2 (docs/PERFORMANCE.md), it keeps perplexity far better than symmetric groups
        # (scale = max |w| / 7): +0.03% against +32% with groups of 32, +28% against +41% with 64.
        return quantize(as_float(weight), self.method, self.group_size, zeros=self.method == "wint4")

    def keeps(self, weight: QuantizedWeight) -> bool:
        """Whether ``weight`` is already what this quantization would make of it (the method,
        its groups, wint4's zero points): it is then kept as stored, not quantized again."""
        same_groups = self.method == "block_wise_fp8" or weight.group_size == self.group_size
        return (weight.method == self.method and same_groups and not weight.layout
                and (weight.zeros is not None) == (self.method == "wint4"))

    def report(self) -> None:
        for source, count in sorted(self.requantized.items()):
            log.info("%d %s weight(s) of the checkpoint quantized again as %s from their float values",
                     count, source, self.method)
