"""Paddle-layout safetensors folders, as Baidu publishes ERNIE 4.5 ``-Paddle`` checkpoints.

What differs from a Hugging Face folder (per Baidu's own Paddle-to-PyTorch converter,
``tools/paddle2torch/tran_4_5t.py`` in PaddlePaddle/ERNIE, and FastDeploy's ERNIE weight table):

* the base model is named after the architecture, ``ernie.layers.0...`` (PaddleFormers does the
  same with ``llama.``, ``qwen3.``...), where transformers says ``model.``;
* a Paddle ``Linear`` keeps its weight ``[in, out]``, so every projection is the transpose of the
  transformers one, and an untied ``lm_head.weight`` is ``[hidden, vocab]``;
* q, k and v are one ``self_attn.qkv_proj`` whose output columns are ``[q | k | v]``, and gate and
  up are one ``up_gate_proj`` whose output columns are ``[gate | up]`` (biases likewise): the dense
  ``mlp.``'s, each routed expert's (``mlp.experts.E.``) and the shared experts'
  (``mlp.shared_experts.``) in MoE checkpoints;
* an MoE layer's router ``mlp.gate.weight`` is a Paddle ``Linear`` too (``[hidden, experts]``),
  and its correction bias is ``mlp.moe_statics.e_score_correction_bias`` ``[1, experts]``, as in
  transformers' folders;
* embeddings and norms are stored as transformers stores them.

The config uses the transformers key names (``hidden_size``, ``rope_theta``, ``use_bias``,
``tie_word_embeddings``...) plus training-only keys (``fuse_*``, ``use_rmsnorm``...), calls the
class ``Ernie4_5_ForCausalLM`` and may leave ``head_dim`` out, meaning hidden / heads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fd_core.errors import CheckpointError
from fd_core.loader.checkpoint import Checkpoint, select_weights
from fd_core.loader.hf_loader import SafetensorsFolder
from fd_core.loader.safetensors_io import SafetensorsSet
from fd_core.models.config import ModelConfig

_FUSED = (".qkv_proj.", ".up_gate_proj.")
_HF_BASE = "model"


def _base_prefix(names: list[str]) -> str | None:
    """The first name component of the decoder-layer tensors (``model``, ``ernie``...)."""
    for name in names:
        head, sep, _ = name.partition(".layers.")
        if sep and "." not in head:
            return head
    return None


def is_paddle_layout(folder: Path) -> bool:
    """Whether ``folder``'s safetensors are in Paddle layout.

    The rule: Paddle layout when any tensor is a fused ``qkv_proj`` / ``up_gate_proj``, or when the
    decoder layers live under a prefix other than ``model.`` (``ernie.layers.0...``). Hugging Face
    checkpoints of the supported architectures never do either. Config keys cannot tell: both sides
    write ``dtype`` now that transformers 5 renamed ``torch_dtype``.
    """
    try:
        names = list(SafetensorsSet(folder).names())
    except CheckpointError:
        return False
    if any(marker in name for name in names for marker in _FUSED):
        return True
    base = _base_prefix(names)
    return base is not None and base != _HF_BASE


class _Fused:
    """Reads a fused tensor once and hands out its column blocks ``[out, in]``, one per call."""

    def __init__(self, tensors: SafetensorsSet, name: str, sizes: list[int]) -> None:
        self.tensors, self.name, self.sizes = tensors, name, sizes
        self._parts: list[np.ndarray] | None = None
        self._served = 0

    def part(self, index: int) -> np.ndarray:
        if self._parts is None:
            fused = self.tensors.read(self.name)
            bounds = np.cumsum(self.sizes)[:-1]
            self._parts = [np.ascontiguousarray(part.T) for part in np.split(fused, bounds, axis=-1)]
        part = self._parts[index]
        self._served += 1
        if self._served == len(self.sizes):  # every block handed out: let the fused copy go
            self._parts, self._served = None, 0
        return part


def _fused_parts(module: str, qkv: tuple[tuple[str, ...], list[int]], config: ModelConfig,
                 shape: tuple[int, ...]) -> tuple[str, tuple[str, ...], list[int]] | None:
    """``(owner prefix, part names, column widths)`` of a fused Paddle module, else None. Every
    ``up_gate_proj`` (the dense MLP's, each routed expert's, the shared experts') is ``[gate | up]``
    in equal halves: the dense one's width is checked against the config here, the experts'
    parts by the shapes the config implies (``select_weights``)."""
    if module.endswith(".self_attn.qkv_proj"):
        return module[: -len("self_attn.qkv_proj")], *qkv
    if module.endswith(".up_gate_proj"):
        owner = module[: -len("up_gate_proj")]
        dense = owner.endswith(".mlp.")
        half = config.intermediate_size if dense else shape[-1] // 2
        return owner, ("gate_proj", "up_proj"), [half, half]
    return None


def _paddle_to_hf(
    config: ModelConfig, tensors: SafetensorsSet, base: str
) -> tuple[dict[str, tuple[int, ...]], dict[str, Callable[[], np.ndarray]]]:
    """For each Hugging Face weight name: its shape and how to read it from the Paddle tensors."""
    shapes: dict[str, tuple[int, ...]] = {}
    readers: dict[str, Callable[[], np.ndarray]] = {}
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), [q, kv, kv]

    def plain(name: str, transpose: bool) -> Callable[[], np.ndarray]:
        if transpose:
            return lambda: np.ascontiguousarray(tensors.read(name).T)
        return lambda: tensors.read(name)

    for name in tensors.names():
        shape = tensors.shape(name)
        hf = _HF_BASE + name[len(base) :] if name.startswith(base + ".") else name
        module, _, kind = hf.rpartition(".")
        fused = _fused_parts(module, qkv, config, shape)
        if fused is not None:
            owner, parts, sizes = fused
            if shape[-1] != sum(sizes):
                raise CheckpointError(
                    f"Fused tensor {name} in {tensors.folder} has {shape[-1]} output columns, "
                    f"but the config implies {sum(sizes)}."
                )
            blocks = _Fused(tensors, name, sizes)
            for index, (part, size) in enumerate(zip(parts, sizes, strict=True)):
                target = f"{owner}{part}.{kind}"
                shapes[target] = (size, *shape[:-1][::-1])
                readers[target] = lambda blocks=blocks, index=index: blocks.part(index)
        elif hf == "lm_head.weight":
            # [hidden, vocab] when untied; some exports keep a tied copy as [vocab, hidden].
            transpose = len(shape) == 2 and shape[0] == config.hidden_size and shape[1] == config.vocab_size
            shapes[hf] = tuple(shape[::-1]) if transpose else tuple(shape)
            readers[hf] = plain(name, transpose)
        elif kind == "weight" and len(shape) == 2 and not hf.endswith("embed_tokens.weight"):
            shapes[hf] = tuple(shape[::-1])
            readers[hf] = plain(name, True)
        else:
            shapes[hf] = tuple(shape)
            readers[hf] = plain(name, False)
    return shapes, readers


def load_paddle(folder: Path, tokenizer: bool = True) -> Checkpoint:
    src = SafetensorsFolder.open(folder, tokenizer=tokenizer)
    config_json = src.config_json
    base = _base_prefix(list(src.tensors.names())) or _HF_BASE
    if "max_position_embeddings" not in config_json and "max_sequence_length" in config_json:
        config_json = {**config_json, "max_position_embeddings": config_json["max_sequence_length"]}
    hidden, heads = config_json.get("hidden_size"), config_json.get("num_attention_heads")
    config = src.model_config(
        config_json,
        head_dim_default=hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None,
    )
    shapes, all_readers = _paddle_to_hf(config, src.tensors, base)
    wanted = select_weights(config, shapes, src.folder)
    readers = {name: all_readers[name] for name in wanted}
    return Checkpoint(path=src.folder, format="paddle", config=config, tokenizer=src.tokenizer, readers=readers)
