"""Hugging Face checkpoints published in FP8: ``config.json`` carries a ``quantization_config``
with ``quant_method: "fp8"``, each quantized linear ``NAME.weight`` is stored as ``F8_E4M3`` with
its scales beside it, and the rest (embedding, norms, layers the config leaves out) in bf16.

Scales come in two forms, both read as ``block_wise_fp8`` (``w = q * scale`` per 128 x 128
block): ``weight_block_size: [128, 128]`` with ``NAME.weight_scale_inv`` ``[ceil(out / 128),
ceil(in / 128)]`` (DeepSeek-V3, Qwen3-FP8; despite its name it multiplies), and one
``NAME.weight_scale`` per tensor, repeated over the blocks (exact). Activation scales
(``input_scale``) are not needed: fd computes activations in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fd_core.errors import CheckpointError
from fd_core.interfaces import FP8_BLOCK, QuantizedWeight
from fd_core.loader.safetensors_io import SafetensorsSet

FP8_TAG = "F8_E4M3"


def quantization_method(config_json: Mapping[str, Any], folder: Path) -> str | None:
    """``"block_wise_fp8"`` for an FP8 checkpoint fd reads, None for a plain one; a
    CheckpointError naming anything else (another method, another block shape)."""
    qc = config_json.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    if method != "fp8":
        raise CheckpointError(f"{folder / 'config.json'}: quantization_config quant_method {method!r} is not one fd "
                              f"reads (it reads fp8; GGUF files keep their own 4/8-bit forms)")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [FP8_BLOCK, FP8_BLOCK]:
        raise CheckpointError(f"{folder / 'config.json'}: FP8 weight_block_size {list(block)}; fd reads "
                              f"{FP8_BLOCK}x{FP8_BLOCK} blocks or one scale per tensor")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{folder / 'config.json'}: FP8 format {fmt!r}; fd reads e4m3")
    return "block_wise_fp8"


def fp8_reader(tensors: SafetensorsSet, name: str, shape: tuple[int, int], folder: Path) -> Callable[[], Any]:
    """A reader for one weight: a ``QuantizedWeight`` when it is stored in FP8, else the plain
    array (a layer the checkpoint left in bf16)."""
    if tensors.dtype_tag(name) != FP8_TAG:
        return lambda: tensors.read(name)
    stem = name.removesuffix(".weight")
    blocks = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))

    def read() -> QuantizedWeight:
        bits = tensors.read(name)
        if stem + ".weight_scale_inv" in tensors:
            scales = tensors.read(stem + ".weight_scale_inv").astype(np.float32)
        elif stem + ".weight_scale" in tensors:
            scales = np.full(blocks, float(tensors.read(stem + ".weight_scale").reshape(-1)[0]), np.float32)
        else:
            raise CheckpointError(f"{folder}: {name} is stored in FP8 but has no {stem}.weight_scale_inv "
                                  f"or {stem}.weight_scale beside it")
        if scales.shape != blocks:
            raise CheckpointError(f"{folder}: {stem}.weight_scale_inv has shape {scales.shape}, expected {blocks} "
                                  f"for a {shape[0]}x{shape[1]} weight in {FP8_BLOCK}x{FP8_BLOCK} blocks")
        return QuantizedWeight("block_wise_fp8", bits, scales, FP8_BLOCK, shape)

    return read
