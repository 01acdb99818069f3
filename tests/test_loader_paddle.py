"""Paddle-layout ERNIE 4.5 folders: the same weights as the Hugging Face folder they were made from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import CheckpointError
from fd_core.loader import load_checkpoint
from fd_core.loader.paddle_loader import is_paddle_layout

try:  # tests/ as a package or as a plain folder on sys.path, whichever pytest set up
    from tests import checkpoints
except ImportError:
    import checkpoints


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("paddle")
    checkpoints.make_ernie45_paddle(tmp)  # writes tmp/ernie45 (HF) and tmp/ernie45-paddle
    return tmp


def _compare_with_transformers(hf_folder: Path, paddle_folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(hf_folder).state_dict()
    checkpoint = load_checkpoint(paddle_folder)
    assert checkpoint.format == "paddle"
    ours = dict(checkpoint.weights())
    expected = set(state) - ({"lm_head.weight"} if checkpoint.config.tie_word_embeddings else set())
    assert set(ours) == expected
    for name, array in ours.items():
        assert array.flags.c_contiguous, name
        np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)


@pytest.mark.oracle
def test_layout_is_detected(tmp):
    assert is_paddle_layout(tmp / "ernie45-paddle")
    assert not is_paddle_layout(tmp / "ernie45")


@pytest.mark.oracle
def test_weights_equal_transformers(tmp):
    _compare_with_transformers(tmp / "ernie45", tmp / "ernie45-paddle")


@pytest.mark.oracle
def test_untied_with_biases(tmp_path):
    pytest.importorskip("transformers")
    paddle = checkpoints.make_ernie45_paddle(tmp_path, tie_word_embeddings=False, use_bias=True)
    checkpoint = load_checkpoint(paddle)
    assert not checkpoint.config.tie_word_embeddings
    assert checkpoint.config.attention_bias and checkpoint.config.o_bias and checkpoint.config.mlp_bias
    _compare_with_transformers(tmp_path / "ernie45", paddle)


CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "o_bias",
    "mlp_bias",
    "rope_scaling",
    "bos_token_id",
    "eos_token_ids",
    "dtype",
)


@pytest.mark.oracle
def test_config_equals_the_hf_folder(tmp):
    paddle = load_checkpoint(tmp / "ernie45-paddle").config
    hf = load_checkpoint(tmp / "ernie45").config
    assert paddle.architecture == "Ernie4_5ForCausalLM"  # config says Ernie4_5_ForCausalLM
    for field in CONFIG_FIELDS:
        assert getattr(paddle, field) == getattr(hf, field), field


@pytest.mark.oracle
def test_tokenizer_equals_transformers(tmp):
    """tokenizer.model alone, as the -Paddle repos ship it, read as LlamaTokenizer (Baidu's converter says so)."""
    from transformers import AutoTokenizer

    folder = tmp / "ernie45-paddle"
    ours, theirs = load_checkpoint(folder).tokenizer, AutoTokenizer.from_pretrained(folder)
    assert ours.vocab_size == len(theirs)
    assert (ours.bos_token_id, ours.eos_token_ids) == (1, frozenset({2}))
    for text in checkpoints.TEST_STRINGS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    for conversation in checkpoints.CONVERSATIONS:
        expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conversation) == expected


# -- a Paddle folder written with NumPy alone ----------------------------------------------------

HIDDEN, INTER, HEADS, KV, HEAD_DIM, VOCAB = 32, 48, 4, 2, 8, 520


def _paddle_folder(folder: Path, *, drop: str | None = None, qkv_width: int | None = None, tied: bool = True):
    """A one-layer ERNIE in Paddle layout, and the HF-layout weights it must load as."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    hf = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN),
        "model.norm.weight": rand(HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": rand(q, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": rand(kv, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": rand(kv, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": rand(HIDDEN, q),
        "model.layers.0.mlp.gate_proj.weight": rand(INTER, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": rand(INTER, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": rand(HIDDEN, INTER),
        "model.layers.0.input_layernorm.weight": rand(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": rand(HIDDEN),
    }
    if not tied:
        hf["lm_head.weight"] = rand(VOCAB, HIDDEN)
    layer = "model.layers.0."
    qkv = np.concatenate([hf[f"{layer}self_attn.{p}_proj.weight"].T for p in "qkv"], axis=1)
    paddle = {
        "ernie.embed_tokens.weight": hf["model.embed_tokens.weight"],
        "ernie.norm.weight": hf["model.norm.weight"],
        "ernie.layers.0.self_attn.qkv_proj.weight": qkv[:, :qkv_width] if qkv_width else qkv,
        "ernie.layers.0.self_attn.o_proj.weight": hf[f"{layer}self_attn.o_proj.weight"].T,
        "ernie.layers.0.mlp.up_gate_proj.weight": np.concatenate(
            [hf[f"{layer}mlp.gate_proj.weight"].T, hf[f"{layer}mlp.up_proj.weight"].T], axis=1
        ),
        "ernie.layers.0.mlp.down_proj.weight": hf[f"{layer}mlp.down_proj.weight"].T,
        "ernie.layers.0.input_layernorm.weight": hf[f"{layer}input_layernorm.weight"],
        "ernie.layers.0.post_attention_layernorm.weight": hf[f"{layer}post_attention_layernorm.weight"],
    }
    if not tied:
        paddle["lm_head.weight"] = hf["lm_head.weight"].T
    if drop:
        del paddle[drop]
    folder.mkdir()
    save_file(
        {k: np.ascontiguousarray(v) for k, v in paddle.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "np"},
    )
    config = {
        "architectures": ["Ernie4_5_ForCausalLM"],
        "model_type": "ernie",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "max_sequence_length": 4096,
        "rope_theta": 500000,
        "use_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32",
        "use_rmsnorm": True,
        "fuse_linear": True,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(checkpoints.byte_level_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return hf


@pytest.mark.parametrize("tied", [True, False])
def test_numpy_paddle_folder(tmp_path, tied):
    hf = _paddle_folder(tmp_path / "ernie", tied=tied)
    checkpoint = load_checkpoint(tmp_path / "ernie")
    assert checkpoint.format == "paddle"
    assert checkpoint.config.max_position_embeddings == 4096  # from max_sequence_length
    assert checkpoint.config.tie_word_embeddings == tied
    ours = dict(checkpoint.weights())
    assert set(ours) == set(hf)
    for name, array in ours.items():
        np.testing.assert_array_equal(array, hf[name], err_msg=name)
    assert checkpoint.tensor("model.layers.0.self_attn.v_proj.weight").shape == (KV * HEAD_DIM, HIDDEN)


def test_head_dim_defaults_to_hidden_over_heads(tmp_path):
    _paddle_folder(tmp_path / "ernie")
    config = json.loads((tmp_path / "ernie" / "config.json").read_text())
    del config["head_dim"]
    (tmp_path / "ernie" / "config.json").write_text(json.dumps(config))
    assert load_checkpoint(tmp_path / "ernie").config.head_dim == HIDDEN // HEADS == HEAD_DIM


def test_missing_fused_tensor_is_named(tmp_path):
    _paddle_folder(tmp_path / "ernie", drop="ernie.layers.0.mlp.up_gate_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight"):
        load_checkpoint(tmp_path / "ernie")


def test_fused_width_must_match_config(tmp_path):
    _paddle_folder(tmp_path / "ernie", qkv_width=HEADS * HEAD_DIM + KV * HEAD_DIM)
    with pytest.raises(CheckpointError, match="qkv_proj"):
        load_checkpoint(tmp_path / "ernie")


@pytest.mark.oracle
def test_moe_folder_gives_the_hf_folders_weights_and_tokens(tmp_path):
    """ERNIE 4.5 MoE in Baidu's Paddle layout (routed and shared experts' fused ``up_gate_proj``
    ``[in, 2I]``, the router ``[hidden, experts]``, ``moe_statics``): the weights the HF folder
    gives, and the same greedy tokens."""
    pytest.importorskip("transformers")
    from fd_core import LLM, SamplingParams

    paddle = checkpoints.make_ernie45_moe_paddle(tmp_path)
    hf = tmp_path / "ernie45_moe"
    assert is_paddle_layout(paddle) and not is_paddle_layout(hf)
    theirs = dict(load_checkpoint(hf).weights())
    checkpoint = load_checkpoint(paddle)
    assert checkpoint.format == "paddle" and checkpoint.config.architecture == "Ernie4_5_MoeForCausalLM"
    ours = dict(checkpoint.weights())
    assert set(ours) == set(theirs)
    assert any(".mlp.experts.7.up_proj." in name for name in ours)
    for name, array in ours.items():
        np.testing.assert_array_equal(np.asarray(array).reshape(np.shape(theirs[name])), theirs[name], err_msg=name)
    prompts = [[5, 9, 14, 3], [7, 7, 21]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in LLM(model=str(folder), device="cpu", max_model_len=64,
                                                      num_kv_blocks=64, block_size=4).generate(prompts, params,
                                                                                                use_tqdm=False)]
              for folder in (hf, paddle)]
    assert tokens[0] == tokens[1]


def test_moe_expert_missing_from_a_paddle_folder_is_named(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file

    paddle = checkpoints.make_ernie45_moe_paddle(tmp_path)
    tensors = load_file(str(paddle / "model.safetensors"))
    del tensors["ernie.layers.2.mlp.experts.5.up_gate_proj.weight"]
    save_file(tensors, str(paddle / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.5\.gate_proj\.weight"):
        load_checkpoint(paddle)
