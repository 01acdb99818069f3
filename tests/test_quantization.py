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
def test_torch_packed_linear_matches_the_spec(method, group, zeros, layout, rows, monkeypatch):
    """ATen's packed kernels (tests/test_cpu_blocks.py tests the AVX2 block kernels, which take
    groups of 32 and 128 instead on a CPU without AVX-512)."""
    torch = pytest.importorskip("torch")
    from fd_core.backends.cpu import blocks, torch_quantized

    monkeypatch.setattr(blocks, "usable", lambda: False)

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


# -- quantizing at load (--quantization) ----------------------------------------------------------


def test_fp8_activations_round_per_row_and_128_columns():
    """spec.fp8_activations (W8A8 block_wise_fp8) is torch's e4m3 cast of x / (max|x| / 448)
    per row and 128-column block, partial last block and all-zero blocks included."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((7, 300)) * rng.uniform(0.01, 100, (7, 1))).astype(np.float32)
    x[2, :128] = 0
    blocks = torch.from_numpy(np.pad(x, ((0, 0), (0, 84)))).reshape(7, 3, 128)
    scale = blocks.abs().amax(-1, keepdim=True) / 448.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    want = ((blocks / safe).to(torch.float8_e4m3fn).float() * scale).reshape(7, -1)[:, :300].numpy()
    got = spec.fp8_activations(x)
    assert np.array_equal(got, want) and not got[2, :128].any()
    assert 0 < np.abs(got - x).max() <= np.abs(x).max() / 16


def test_e4m3_rounding_is_torchs():
    """The NumPy float8 e4m3fn rounding gives the bits torch's cast gives: ties to even, the
    subnormals, saturation at 448, signs."""
    torch = pytest.importorskip("torch")
    from fd_core.quantization.quantize import e4m3_bits

    rng = np.random.default_rng(0)
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    finite = every[np.isfinite(every)]
    middles = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2  # exact ties
    x = np.concatenate([finite, middles, np.nextafter(middles, np.inf), np.nextafter(middles, -np.inf),
                        rng.standard_normal(20000) * 30, rng.standard_normal(20000) * 0.01,
                        [500.0, -1e9, 448.0, 464.0, 2.0**-10, -(2.0**-10)]]).astype(np.float32)
    x = x[np.abs(x) <= 448]  # beyond 448 torch gives NaN; the quantizer's scales never go there
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = e4m3_bits(x)
    values = torch.from_numpy(got).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(values, torch.from_numpy(want).view(torch.float8_e4m3fn).float().numpy())
    assert e4m3_bits(np.array([500.0, -1e9], np.float32)).tolist() == [0x7E, 0xFE]  # saturated


@pytest.mark.parametrize("method, group", [("wint8", -1), ("wint4", 128), ("wint4", 32), ("block_wise_fp8", 128)])
def test_quantizing_rounds_to_the_nearest_level(method, group):
    from fd_core.quantization.quantize import quantize

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((200, 384)) * 0.05).astype(np.float32)
    w[7] = 0  # an all-zero row: scale 0 must not give NaN
    q = quantize(w, method, group)
    back = dequantize(q)
    assert np.isfinite(back).all() and not back[7].any()
    if method == "block_wise_fp8":
        assert q.qweight.dtype == np.uint8 and q.scales.shape == (2, 3)
        # e4m3 keeps 3 mantissa bits: half a step is 2**-4 of the value (subnormals: of the block's max)
        bound = np.maximum(np.abs(w) * 2**-4, np.repeat(np.repeat(q.scales, 128, 0), 128, 1)[:200, :384] * 2**-10)
    else:
        step = np.repeat(q.scales, q.shape[1] if group == -1 else group, axis=1)
        bound = step / 2
        assert q.qweight.dtype == np.int8 and np.abs(q.qweight).max() <= (127 if method == "wint8" else 8)
    assert (np.abs(back - w) <= bound * (1 + 1e-6) + 1e-12).all()


def test_load_time_quantization_keeps_the_float_models_logits(tmp_path):
    """A tiny Llama quantized at load (torch runtime, packed kernels) gives the float load's
    logits within each method's error, its linears packed, the embedding and head in float32;
    a group size that does not divide a layer's input features is refused naming the layer."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from fd_core import LLM
    from tests import checkpoints
    from tests.oracle import fd_greedy_logits

    model = str(checkpoints.make_llama(tmp_path))
    args = dict(model=model, device="cpu", runtime="torch", max_model_len=64, num_kv_blocks=32)
    prompt = list(range(3, 40))
    tokens, want = fd_greedy_logits(LLM(**args), prompt, 4)
    from fd_core.backends.cpu import blocks

    int4 = "cpu_blocks_q4_1" if blocks.usable() else "cpu_int4pack"  # AVX2 without AVX-512: the block kernels
    for method, group, layout, tolerance in [("wint8", None, "cpu_int8pack", 0.03),
                                             ("wint4", 32, int4, 0.25)]:
        llm = LLM(quantization=method, quantization_group_size=group, **args)
        runner = llm.engine.runner
        layer = runner.model.layers[0]
        assert (layer.qkv.layout, layer.gate_up.layout, layer.down.layout) == (layout,) * 3
        assert not isinstance(runner.model.lm_head, QuantizedWeight)
        got_tokens, got = fd_greedy_logits(llm, prompt, 4)
        # teacher-forced on the float model's tokens where they agree; logits are O(1) here
        same = next((i for i, (a, b) in enumerate(zip(tokens, got_tokens)) if a != b), len(tokens))
        error = np.abs(got[: same + 1] - want[: same + 1]).max() / np.abs(want).max()
        assert error < tolerance, f"{method}: relative logit error {error:.3f}"
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight: its 64 input "
                                              r"features do not divide into wint4 groups of 128"):
        LLM(quantization="wint4", **args)  # the default group of 128 > the tiny model's 64


# -- Hugging Face FP8 checkpoints ----------------------------------------------------------------------


def _fp8_copy(source, folder, per_tensor: bool = False):
    """``source`` (a float HF folder) with every decoder linear stored as an FP8 checkpoint stores
    it, and the same model with those linears at their FP8 values in float32 (the oracle's)."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from fd_core.quantization.quantize import quantize

    fp8, plain = folder / "fp8", folder / "plain"
    for out in (fp8, plain):
        shutil.copytree(source, out)
        (out / "model.safetensors").unlink()
    tensors = load_file(str(source / "model.safetensors"))
    stored, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            w = t.float().numpy()
            if per_tensor:
                scale = np.abs(w).max() / 448.0
                q = quantize(w / scale, "block_wise_fp8", 128)  # only its bits are kept
                bits, scales = q.qweight, np.full_like(q.scales, scale)
                stored[name[: -len(".weight")] + ".weight_scale"] = torch.tensor([scale], dtype=torch.float32)
            else:
                q = quantize(w, "block_wise_fp8", 128)
                bits, scales = q.qweight, q.scales
                stored[name[: -len(".weight")] + ".weight_scale_inv"] = torch.from_numpy(scales)
            stored[name] = torch.from_numpy(bits).view(torch.float8_e4m3fn)
            dequantized[name] = torch.from_numpy(dequantize(QuantizedWeight("block_wise_fp8", bits, scales, 128,
                                                                            w.shape)))
        else:
            stored[name] = dequantized[name] = t
    save_file(stored, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(plain / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = ({"quant_method": "fp8", "activation_scheme": "dynamic"} if per_tensor else
                                     {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]})
    (fp8 / "config.json").write_text(json.dumps(config))
    return fp8, plain


@pytest.mark.oracle
@pytest.mark.parametrize("per_tensor", [False, True], ids=["block-scales", "per-tensor-scale"])
def test_hf_fp8_checkpoint_loads_as_block_wise_fp8(tmp_path, per_tensor):
    """An FP8 checkpoint (F8_E4M3 weights with weight_scale_inv or weight_scale) is read as
    block_wise_fp8 weights, and its logits are transformers' on the same values in float32
    (the CPU declares no fp8: the weights are dequantized at load)."""
    pytest.importorskip("transformers")
    from fd_core import LLM
    from fd_core.loader import load_checkpoint
    from tests import checkpoints
    from tests.oracle import fd_greedy_logits, hf_logits, relative_error

    fp8, plain = _fp8_copy(checkpoints.make_llama(tmp_path / "src", intermediate_size=200), tmp_path,
                           per_tensor)
    weight = dict(load_checkpoint(fp8).weights())["model.layers.1.mlp.down_proj.weight"]
    assert isinstance(weight, QuantizedWeight) and weight.method == "block_wise_fp8"
    assert weight.qweight.dtype == np.uint8 and weight.scales.shape == (1, 2)  # 64 x 200: partial blocks
    llm = LLM(model=str(fp8), block_size=4, num_kv_blocks=64, max_model_len=128)
    prompt = list(range(5, 16))
    tokens, ours = fd_greedy_logits(llm, prompt, 4)
    theirs = hf_logits(plain, prompt + tokens[:-1])[len(prompt) - 1:]
    assert max(relative_error(a, b) for a, b in zip(ours, theirs)) <= 1e-4


def test_other_checkpoint_quantization_is_refused_by_name(tmp_path):
    import json

    from fd_core.loader import load_checkpoint
    from tests import checkpoints

    folder = checkpoints.make_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    for qc, message in [({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not one fd reads"),
                        ({"quant_method": "fp8", "weight_block_size": [1, 128]}, "FP8 weight_block_size \\[1, 128\\]")]:
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(folder)


@pytest.mark.parametrize("method, group, zeros", [("wint8", -1, False), ("wint4", 128, True), ("wint8", 32, False),
                                                  ("block_wise_fp8", 128, False)])
def test_quantizing_in_row_bands_changes_nothing(monkeypatch, method, group, zeros):
    """Quantizers run on bands of rows (several threads); FP8's bands are whole 128-row blocks.
    Bands of 3 rows (128 for FP8), the last one partial, give the bytes one band gives."""
    from fd_core.quantization import quantize as module

    w = (np.random.default_rng(5).standard_normal((300, 256)) * 0.05).astype(np.float32)
    w[129] = 0
    monkeypatch.setattr(module, "BAND_VALUES", 1 << 30)
    whole = module.quantize(w, method, group, zeros)
    monkeypatch.setattr(module, "BAND_VALUES", 3 * 256)
    fp8 = method == "block_wise_fp8"
    assert len(module.by_row_bands(len, w, 128 if fp8 else 1)) == (3 if fp8 else 100)
    banded = module.quantize(w, method, group, zeros)
    for name in ("qweight", "scales", "zeros"):
        a, b = getattr(whole, name), getattr(banded, name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    assert banded.shape == whole.shape and banded.group_size == whole.group_size
