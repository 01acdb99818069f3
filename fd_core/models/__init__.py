"""Model definitions, written once for every chip, and the architecture registry."""

from __future__ import annotations

from typing import Any

from fd_core.errors import UnsupportedArchitectureError
from fd_core.interfaces import Memory
from fd_core.models.config import ModelConfig
from fd_core.models.decoder import DecoderForCausalLM, DecoderTraits
from fd_core.models.moe import MoeSpec
from fd_core.models.parallel import TensorParallel

# Hugging Face class name -> how to build it. Adding a variant of a known family is one line here.
ARCHITECTURES: dict[str, DecoderTraits] = {
    "LlamaForCausalLM": DecoderTraits(rope_style="neox"),
    "Qwen3ForCausalLM": DecoderTraits(rope_style="neox", qk_norm=True),
    "Ernie4_5ForCausalLM": DecoderTraits(rope_style="interleaved"),
    "Qwen3MoeForCausalLM": DecoderTraits(rope_style="neox", qk_norm=True, moe="qwen3"),
    "Ernie4_5_MoeForCausalLM": DecoderTraits(rope_style="interleaved", moe="ernie"),
}


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model of ``config`` loads, HF-named, with its ``[out, in]`` shape."""
    return _traits(config).weight_shapes(config)


def _traits(config: ModelConfig) -> DecoderTraits:
    traits = ARCHITECTURES.get(config.architecture)
    if traits is None:
        raise UnsupportedArchitectureError(
            f"architecture {config.architecture!r} is not supported; fd supports "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return traits


def moe_spec(config: ModelConfig) -> MoeSpec | None:
    """The model's mixture-of-experts layers, None for a dense model."""
    return _traits(config).moe_spec(config)


def build_model(config: ModelConfig, ops: Any, memory: Memory, max_model_len: int,
                dtype: str = "float32", tp: TensorParallel | None = None) -> DecoderForCausalLM:
    return DecoderForCausalLM(config, _traits(config), ops, memory, max_model_len, dtype, tp)


__all__ = ["ARCHITECTURES", "ModelConfig", "MoeSpec", "TensorParallel", "build_model", "moe_spec", "weight_shapes"]
