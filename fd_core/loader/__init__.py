"""Checkpoint loading: GGUF, Hugging Face and Paddle safetensors folders, into one ModelConfig,
one Tokenizer and a stream of NumPy weights named and laid out as in Hugging Face."""

from fd_core.loader.checkpoint import SUPPORTED_ARCHITECTURES, Checkpoint
from fd_core.loader.formats import load_checkpoint
from fd_core.loader.resolve import DEFAULT_MODEL, resolve_model

__all__ = ["DEFAULT_MODEL", "SUPPORTED_ARCHITECTURES", "Checkpoint", "load_checkpoint", "resolve_model"]
