"""A tiny random-weight Llama checkpoint, and its greedy continuation computed with the NumPy
specification alone: the conformance kit's end-to-end test runs the model on a backend and
holds the tokens to this. Needs only fd-core's own dependencies (safetensors, tokenizers)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fd_core.interfaces import AttentionMetadata
from fd_core.testing import spec


@dataclass(frozen=True)
class TinyLlama:
    """Sizes of the kit's model: GQA (two query heads per key-value head), untied LM head."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def random_weights(shape: TinyLlama, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names, ``[out, in]`` float32. Scaled so activations stay near unit size and
    the logits of a step are spread out (greedy choices are rarely near-ties)."""
    rng = np.random.default_rng(seed)
    h, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(h)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((shape.vocab_size, h)).astype(np.float32)}
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": mat(q, h, 2.0),
            p + "self_attn.k_proj.weight": mat(kv, h, 2.0),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, q),
            p + "mlp.gate_proj.weight": mat(inter, h),
            p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
        }
    weights["model.norm.weight"] = norm()
    weights["lm_head.weight"] = mat(shape.vocab_size, h, 4.0)
    return weights


def write_checkpoint(folder: Path, shape: TinyLlama = TinyLlama(), seed: int = 0) -> dict[str, np.ndarray]:
    """Write a Hugging Face Llama folder (config, safetensors, a word-level tokenizer whose
    tokens are ``t0``, ``t1``...) and return its weights."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = random_weights(shape, seed)
    save_file(weights, str(folder / "model.safetensors"))
    eos = shape.vocab_size - 1
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": shape.rms_norm_eps, "rope_theta": shape.rope_theta,
        "max_position_embeddings": shape.max_position_embeddings, "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": eos,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = {f"t{i}": i for i in range(shape.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "t0", "eos_token": f"t{eos}", "add_bos_token": False}))
    return weights


def write_mtp_weights(folder: Path, seed: int = 1) -> Path:
    """Random weights of a multi-token-prediction layer (``fd_core/models/mtp.py``: ERNIE 4.5's
    names) for the model in ``folder`` (its config.json gives the shapes), in a file of their
    own beside its checkpoint: what the ``mtp`` proposer reads."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    c = json.loads((folder / "config.json").read_text())
    layer = TinyLlama(hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"], num_hidden_layers=1,
                      num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"])
    if (c.get("head_dim") or layer.head_dim) != layer.head_dim:
        raise ValueError(f"{folder}: a head size other than hidden_size / num_attention_heads is not drawn here")
    h = layer.hidden_size
    weights = random_weights(layer, seed)
    rng = np.random.default_rng(seed + 1)
    out = {k.replace("model.layers.0.", "model.mtp_block.0."): v for k, v in weights.items() if ".layers.0." in k}
    out |= {
        "model.mtp_emb_norm.0.weight": (1.0 + 0.2 * rng.standard_normal(h)).astype(np.float32),
        "model.mtp_hidden_norm.0.weight": (1.0 + 0.2 * rng.standard_normal(h)).astype(np.float32),
        "model.mtp_linear_proj.0.weight": (rng.standard_normal((h, 2 * h)) / np.sqrt(2 * h)).astype(np.float32),
    }
    save_file(out, str(folder / "mtp.safetensors"))
    return folder


def _forward(weights: dict[str, np.ndarray], shape: TinyLlama, ids: list[int]) -> np.ndarray:
    """Logits of the last token of ``ids``, the whole sequence recomputed: the spec's ops, one
    sequence, no paging."""
    n, d = len(ids), shape.head_dim
    hq, hk, eps = shape.num_attention_heads, shape.num_key_value_heads, shape.rms_norm_eps
    positions = np.arange(n, dtype=np.int64)
    inv = 1.0 / (shape.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.arange(n, dtype=np.float32)[:, None] * inv.astype(np.float32)[None, :]
    cos_sin = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
    meta = AttentionMetadata(
        query_start_loc=np.array([0, n], np.int64), seq_lens=np.array([n], np.int64),
        context_lens=np.array([0], np.int64), block_tables=np.array([[0]], np.int64),
        slot_mapping=positions.copy(), block_size=n,
    )
    x = spec.embedding(weights["model.embed_tokens.weight"], np.asarray(ids, np.int64))
    for i in range(shape.num_hidden_layers):
        w = {k.split(f"layers.{i}.", 1)[1]: v for k, v in weights.items() if f"layers.{i}." in k}
        h = spec.rms_norm(x, w["input_layernorm.weight"], eps)
        q = spec.linear(h, w["self_attn.q_proj.weight"]).reshape(n, hq, d)
        k = spec.linear(h, w["self_attn.k_proj.weight"]).reshape(n, hk, d)
        v = spec.linear(h, w["self_attn.v_proj.weight"]).reshape(n, hk, d)
        q, k = spec.rotary(positions, q, k, cos_sin, "neox")  # Hugging Face Llama rotates halves
        cache = (np.zeros((n, hk, d), np.float32), np.zeros((n, hk, d), np.float32))
        attn = spec.attention(q, k, v, cache, meta, d**-0.5).reshape(n, hq * d)
        x = x + spec.linear(attn, w["self_attn.o_proj.weight"])
        h = spec.rms_norm(x, w["post_attention_layernorm.weight"], eps)
        gate_up = np.concatenate([spec.linear(h, w["mlp.gate_proj.weight"]), spec.linear(h, w["mlp.up_proj.weight"])], -1)
        x = x + spec.linear(spec.silu_and_mul(gate_up), w["mlp.down_proj.weight"])
    x = spec.rms_norm(x[-1:], weights["model.norm.weight"], eps)
    return spec.linear(x, weights["lm_head.weight"])[0]


def greedy_reference(weights: dict[str, np.ndarray], shape: TinyLlama, prompt: list[int],
                     max_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """The spec's greedy continuation of ``prompt`` and the log-probabilities of every step."""
    ids, steps = list(prompt), []
    for _ in range(max_tokens):
        logits = _forward(weights, shape, ids).astype(np.float64)
        logprobs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        steps.append(logprobs)
        ids.append(int(np.argmax(logprobs)))
    return ids[len(prompt):], steps
