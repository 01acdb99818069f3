"""``--load-format dummy`` (vLLM's flag): the weights a model's config implies, drawn at random
instead of read from a checkpoint, to measure speed and memory on shapes whose weights one
does not have (ERNIE-4.5-21B-A3B at full depth, say). The folder still gives ``config.json``
and the tokenizer; no weight file is opened, and none need exist.

Values come from one pool of random numbers per kind, each tensor a slice of it repeated to
its size: drawing 21 billion normals would take minutes, copying takes seconds. Matrices are
0.02-scaled normals, norms near one, ERNIE's correction bias zero. With ``--quantization`` the
decoder's linears come out already in that method's canonical form (random levels, scales
that give the float weights' magnitude), which ``LoadQuantization`` keeps as they are, so no
float matrix is ever quantized."""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from pathlib import Path

import numpy as np

from fd_core.errors import ModelNotFoundError
from fd_core.interfaces import FP8_BLOCK, QuantizedWeight
from fd_core.loader.checkpoint import Checkpoint
from fd_core.loader.hf_loader import SafetensorsFolder
from fd_core.models import weight_shapes
from fd_core.quantization.host import HostWeight

_POOL = 1 << 22
_SCALE = 0.02


class _Pool:
    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.normal = rng.standard_normal(_POOL, dtype=np.float32) * np.float32(_SCALE)
        self.bytes = rng.integers(0, 256, _POOL, dtype=np.uint8)
        # each quantized method's levels made once, so a tensor is one copy out of its pool
        self.int8 = self.bytes.view(np.int8)
        self.int4 = (self.bytes & 0xF).view(np.int8) - np.int8(8)
        # no NaN pattern (0x7F / 0xFF): exponent bit 1 cleared, so exponents up to 13, |q| <= 120
        self.fp8 = self.bytes & np.uint8(0xEF)
        self._next = 0

    def take(self, values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """``shape`` filled with ``values[offset:]`` repeated, a new offset for every tensor."""
        self._next = (self._next + 7919) % (_POOL // 2)
        size = prod(shape)
        out = np.empty(size, dtype=values.dtype)
        first = values[self._next:self._next + size]
        out[: first.size] = first
        # np.resize's repetition (the same values), filled by doubling: each copy is one memcpy
        # of the prefix, a whole number of periods. With np.resize and the levels made per
        # tensor, a wint4 expert of the 300B-A47B took 65 ms (13.5 now): 636 s a rank for
        # its 9,792 expert matrices with the experts sliced (EP off)
        filled = first.size
        while filled < size:
            step = min(filled, size - filled)
            out[filled:filled + step] = out[:step]
            filled += step
        return out.reshape(shape)


def _quantized(pool: _Pool, shape: tuple[int, int], method: str, group_size: int) -> QuantizedWeight:
    out_features, in_features = shape
    if method == "block_wise_fp8":
        blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        return QuantizedWeight(method, pool.take(pool.fp8, shape), np.full(blocks, _SCALE / 120, np.float32),
                               FP8_BLOCK, shape)
    top = 127 if method == "wint8" else 7
    levels = pool.take(pool.int8 if method == "wint8" else pool.int4, shape)
    groups = 1 if group_size == -1 else in_features // group_size
    scales = np.full((out_features, groups), _SCALE * 2 / top, np.float32)
    # wint4 loads with zero points (LoadQuantization): a zero of the same form keeps it as is
    zeros = np.zeros_like(scales) if method == "wint4" else None
    return QuantizedWeight(method, levels, scales, group_size, shape, zeros)


def load_dummy(folder: Path, quantization: tuple[str, int] | None = None, seed: int = 0,
               tokenizer: bool = True) -> Checkpoint:
    """A Hugging Face model folder's config and tokenizer, with random weights. ``quantization``
    is ``(method, group_size)`` of ``--quantization``: the decoder's linears are made in it."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(
            f"--load-format dummy needs a model folder with a config.json (and a tokenizer); {folder} has none")
    src = SafetensorsFolder.open(folder, tensors=False, tokenizer=tokenizer)
    stored = str(src.config_json.get("torch_dtype") or src.config_json.get("dtype") or "bfloat16")
    config = src.model_config(dtype=stored if stored in ("float32", "float16", "bfloat16") else "bfloat16")
    pool = _Pool(seed)

    def reader(name: str, shape: tuple[int, ...]) -> Callable[[], HostWeight]:
        if name.endswith("norm.weight"):
            return lambda: 1 + pool.take(pool.normal, shape)
        if name.endswith("e_score_correction_bias"):
            return lambda: np.zeros(shape, np.float32)
        if quantization is not None and len(shape) == 2 and name.endswith("_proj.weight"):
            return lambda: _quantized(pool, shape, *quantization)  # type: ignore[arg-type]
        return lambda: pool.take(pool.normal, shape)

    readers = {name: reader(name, shape) for name, shape in weight_shapes(config).items()}
    return Checkpoint(path=folder, format="dummy", config=config, tokenizer=src.tokenizer, readers=readers)
