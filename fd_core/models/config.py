"""ModelConfig: the one normalised description of a decoder that every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Loader-independent model hyper-parameters.

    ``architecture`` is the Hugging Face class name (``LlamaForCausalLM``,
    ``Qwen3ForCausalLM``, ``Ernie4_5ForCausalLM``...), whatever the file format was. Weights that
    go with it are named as in the Hugging Face checkpoint (``model.layers.0.self_attn.q_proj.weight``)
    and linear weights are laid out ``[out, in]``, whatever the file format was.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v projections
    o_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    # HF rope_scaling / rope_parameters, minus theta; a dict, so left out of the hash
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # dtype the checkpoint was stored in
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
