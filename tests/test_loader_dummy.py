"""``--load-format dummy``: random weights from a model folder's config, no weight file read."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core import LLM, SamplingParams
from fd_core.engine.config import EngineConfig
from fd_core.errors import ConfigError, ModelNotFoundError
from fd_core.interfaces import QuantizedWeight
from fd_core.loader.dummy import load_dummy
from fd_core.models import weight_shapes
from fd_core.quantization.host import dequantize
from fd_core.quantization.quantize import LoadQuantization, quantize
from tests import checkpoints


def _weightless(folder):
    for file in folder.glob("*.safetensors*"):
        file.unlink()
    return folder


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return _weightless(checkpoints.make_ernie45_moe(tmp_path_factory.mktemp("dummy")))


def test_every_weight_of_the_config_at_its_shape(moe_folder):
    checkpoint = load_dummy(moe_folder)
    weights = dict(checkpoint.weights())
    shapes = weight_shapes(checkpoint.config)
    assert {n: w.shape for n, w in weights.items()} == shapes
    embed = weights["model.embed_tokens.weight"]
    assert embed.dtype == np.float32 and 0.01 < float(embed.std()) < 0.03
    norm = next(w for n, w in weights.items() if n.endswith("input_layernorm.weight"))
    assert abs(float(norm.mean()) - 1) < 0.01


@pytest.mark.parametrize("method,group", [("wint8", -1), ("wint4", 16), ("block_wise_fp8", 128)])
def test_with_quantization_the_linears_come_quantized_and_load_time_quantization_keeps_them(moe_folder, method,
                                                                                           group):
    checkpoint = load_dummy(moe_folder, (method, group))
    keep = LoadQuantization(method, group)
    for name, weight in checkpoint.weights():
        if name.endswith("_proj.weight"):
            assert isinstance(weight, QuantizedWeight) and weight.method == method
            assert keep(name, weight) is weight  # already in the asked form: not quantized again
            assert np.isfinite(dequantize(weight)).all()
        else:
            assert isinstance(weight, np.ndarray)
    assert not keep.requantized


def test_load_time_quantization_still_requantizes_another_form():
    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    q8 = quantize(w, "wint8", 32)
    keep = LoadQuantization("wint8", -1)
    again = keep("x_proj.weight", q8)
    assert again is not q8 and again.group_size == -1 and keep.requantized == {"wint8": 1}
    symmetric = quantize(w, "wint4", 16)  # LoadQuantization's wint4 has zero points
    assert LoadQuantization("wint4", 16)("x_proj.weight", symmetric).zeros is not None


@pytest.mark.parametrize("runtime,quantization", [("paddle", None), ("torch", "wint4")])
def test_a_folder_without_weights_serves_with_dummy(moe_folder, runtime, quantization):
    group = {"quantization_group_size": 16} if quantization else {}
    with pytest.raises(Exception, match="safetensors|no model|weight"):
        LLM(model=str(moe_folder), device="cpu", runtime=runtime)  # the usual load still needs weights
    llm = LLM(model=str(moe_folder), device="cpu", runtime=runtime, load_format="dummy", quantization=quantization,
              **group, max_model_len=64, num_kv_blocks=64, block_size=4)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_bad_load_format_and_a_gguf_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--load-format nope: accepted values are auto, dummy"):
        EngineConfig(model="x", load_format="nope").validate()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="--load-format dummy needs a model folder with a config.json"):
        load_dummy(gguf)
