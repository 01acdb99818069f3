"""Quantized weights: GGUF blocks kept as wint8/wint4 exactly, fused and split on the host
exactly, and the CPU's packed torch kernels against the NumPy specification."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.errors import CheckpointError
from fd_core.interfaces import QuantizedWeight
from fd_core.quantization import gguf as gguf_quants
from fd_core.quantization.host import concat_rows, dequantize, permute_rows, take
from fd_core.testing import spec


def _raw_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in ``type_name``'s layout, its float16 factors small and finite."""
    per_block, nbytes = gguf_quants.BLOCKS[type_name]
    raw = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    offsets = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}[type_name]
    for off in offsets:
        f16 = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., off:off + 2] = f16.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(gguf_quants.KEPT))
def test_gguf_blocks_are_kept_exactly(type_name):
    """Each kept type, decoded to wint8/wint4, stands for exactly the values gguf's own
    dequantizer gives."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    rng = np.random.default_rng(len(type_name))
    raw = _raw_blocks(type_name, 6, 512, rng)
    weight = gguf_quants.decode(type_name, raw, (6, 512))
    want = gguf_dequantize(raw, GGMLQuantizationType[type_name]).reshape(6, 512)
    # exact but for the zero of Q4_1/Q4_K, one float32 addition (gguf computes d * q + m directly)
    np.testing.assert_allclose(dequantize(weight), want, rtol=0, atol=np.abs(want).max() * 2**-22)
    low = -8 if weight.method == "wint4" else -128
    assert weight.qweight.dtype == np.int8 and weight.qweight.min() >= low
    assert weight.qweight.max() <= (7 if weight.method == "wint4" else 127)
    assert (weight.method, weight.group_size) == {"Q8_0": ("wint8", 32), "Q4_0": ("wint4", 32),
                                                  "Q4_1": ("wint4", 32), "Q4_K": ("wint4", 32),
                                                  "Q6_K": ("wint8", 16)}[type_name]


def _mixed_parts(rng: np.random.Generator) -> list[QuantizedWeight]:
    q4k = gguf_quants.decode("Q4_K", _raw_blocks("Q4_K", 4, 256, rng), (4, 256))
    q6k = gguf_quants.decode("Q6_K", _raw_blocks("Q6_K", 2, 256, rng), (2, 256))
    q40 = gguf_quants.decode("Q4_0", _raw_blocks("Q4_0", 3, 256, rng), (3, 256))
    return [q4k, q6k, q40]


def test_fusing_mixed_quantized_parts_is_exact():
    """A layer mixing Q4_K, Q6_K and Q4_0 (as llama.cpp's _M files do) fuses into one weight in
    the widest form (wint8, the smallest group), standing for the same values."""
    parts = _mixed_parts(np.random.default_rng(0))
    fused = concat_rows(parts)
    assert isinstance(fused, QuantizedWeight) and (fused.method, fused.group_size) == ("wint8", 16)
    np.testing.assert_array_equal(dequantize(fused), np.concatenate([dequantize(p) for p in parts]))
    same = concat_rows(parts[:1] * 2)
    assert (same.method, same.group_size) == ("wint4", 32)


def test_tensor_parallel_parts_and_row_order_are_exact():
    weight = concat_rows(_mixed_parts(np.random.default_rng(1)))
    full = dequantize(weight)
    np.testing.assert_array_equal(dequantize(take(weight, 0, 2, 7, "w")), full[2:7])
    np.testing.assert_array_equal(dequantize(take(weight, 1, 128, 256, "w")), full[:, 128:256])
    with pytest.raises(CheckpointError, match="w: input columns 8:136 split a quantization group of 16"):
        take(weight, 1, 8, 136, "w")
    order = np.random.default_rng(2).permutation(weight.shape[0])
    np.testing.assert_array_equal(dequantize(permute_rows(weight, order)), full[order])


# -- the CPU's packed kernels (torch runtime) ---------------------------------------------------


def _quantized(method: str, out_f: int, in_f: int, group: int, zeros: bool, rng) -> QuantizedWeight:
    top = 7 if method == "wint4" else 127
    q = rng.integers(-top - 1, top + 1, (out_f, in_f)).astype(np.int8)
    groups = 1 if group == -1 else in_f // group
    # weights of magnitude ~ in**-0.5, as a trained layer's, so that outputs are ~1
    scales = ((rng.random((out_f, groups)) + 0.5) * 2 / top * in_f**-0.5).astype(np.float32)
    z = (rng.standard_normal((out_f, groups)) * in_f**-0.5).astype(np.float32) if zeros else None
    return QuantizedWeight(method, q, scales, group, (out_f, in_f), z)


@pytest.mark.parametrize("method, group, zeros, layout", [
    ("wint4", 32, True, "cpu_int4pack"),
    ("wint4", 128, False, "cpu_int4pack"),
    ("wint4", -1, False, "cpu_int4pack"),  # one group of 256 columns
    ("wint8", -1, False, "cpu_int8pack"),
    ("wint8", -1, True, "cpu_int8pack"),
    ("wint8", 32, False, "cpu_bf16"),  # GGUF Q8_0
    ("wint8", 16, False, "cpu_bf16"),  # GGUF Q6_K
    ("wint4", 16, True, "cpu_bf16"),  # a group the int4 kernel does not take
])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_torch_packed_linear_matches_the_spec(method, group, zeros, layout, rows):
    torch = pytest.importorskip("torch")
    from fd_core.backends.cpu import torch_quantized

    rng = np.random.default_rng(rows)
    weight = _quantized(method, 96, 256, group, zeros, rng)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    bias = rng.standard_normal(96).astype(np.float32)
    on_device = QuantizedWeight(method, torch.from_numpy(weight.qweight), torch.from_numpy(weight.scales),
                                group, weight.shape, None if weight.zeros is None else torch.from_numpy(weight.zeros))
    packed = torch_quantized.pack_linear(on_device)
    assert packed.layout == layout
    got = torch_quantized.linear(torch.from_numpy(x), packed, torch.from_numpy(bias))
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), spec.linear(x, weight, bias),
                               **spec.tolerance("linear", "float32", method))
