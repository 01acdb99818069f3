"""GGUF files (llama.cpp's format): config and tokenizer from metadata, weights kept quantized where
the type maps onto fd's wint8/wint4 exactly (``fd_core.quantization.gguf``), else dequantized to float32.

Weights come out as ``transformers.AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`` holds
them: Hugging Face names, ``[out, in]`` layout, and for Llama the rows of ``attn_q``/``attn_k``
put back in the order the Hugging Face rotary expects (llama.cpp's converter interleaves them).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fd_core.errors import CheckpointError, UnsupportedArchitectureError
from fd_core.interfaces import QuantizedWeight
from fd_core.loader.checkpoint import SUPPORTED_ARCHITECTURES, Checkpoint, select_weights
from fd_core.loader.tokenizer import (
    CONTROL,
    USER_DEFINED,
    TextTokenizer,
    add_plain_tokens,
    add_special_tokens,
    byte_alphabet,
    sentencepiece_bpe,
    set_bos_eos,
)
from fd_core.models.config import ModelConfig
from fd_core.quantization import gguf as gguf_quants
from fd_core.quantization.host import HostWeight, permute_rows

log = logging.getLogger("fd.loader")

# general.architecture -> Hugging Face class, and whether llama.cpp permuted q/k rows for it.
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", False),
}

# GGUF tensor name pieces -> Hugging Face ones.
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")

# Pre-tokenizer split patterns for byte-level vocabularies, by tokenizer.ggml.pre. Any value not
# listed here or in _DIGITS_FIRST keeps GPT-2's ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


# Vocabularies trained with every digit its own pre-token (StarCoder's family, SmolLM2 among them):
# llama.cpp isolates each digit before GPT-2's regex, as the original tokenizer.json does. transformers'
# GGUF converter (5.23) does not, and so differs on whitespace before a digit ("Hello  12"); we follow
# the model's own tokenizer.
_DIGITS_FIRST = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key with a scalar or string value (arrays such as the vocabulary left out)."""
    from gguf import GGUFValueType

    values = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != GGUFValueType.ARRAY:
            values[key] = field.contents()
    return values


def unpermute_rotary_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order for Llama.

    llama.cpp wants each head's rotary pairs adjacent (row 2i next to 2i+1) while Hugging Face keeps
    the two halves of a head apart (row i pairs with row i + d/2). Within each head, the converter
    stored half-row ``j`` of pair position ``i`` at row ``2i + j``; reading the rows back as
    ``[head, i, j]`` and swapping the last two axes restores ``[head, j, i]``.
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_config(reader: Any, path: Path) -> tuple[ModelConfig, dict[str, Any], bool]:
    metadata = read_metadata(reader)
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"{path} holds a GGUF '{arch}' model, which fd does not support (supported: {supported})."
        )
    architecture, permuted = _ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    def need(name: str) -> Any:
        if f"{arch}.{name}" not in metadata:
            raise KeyError(name)
        return metadata[f"{arch}.{name}"]

    try:
        hidden = int(need("embedding_length"))
        heads = int(need("attention.head_count"))
        kv_heads = key("attention.head_count_kv", heads)
        head_dim = key("attention.key_length") or (key("rope.dimension_count") if arch == "llama" else None)
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = key("vocab_size") or (len(tokens.data) if tokens is not None else None)
        if vocab is None:
            raise KeyError("vocab_size")
        names = {tensor.name for tensor in reader.tensors}
        config = ModelConfig(
            architecture=architecture,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_hidden_layers=int(need("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim or hidden // heads),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            o_bias="blk.0.attn_output.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
            rope_scaling=_rope_scaling(metadata, arch),
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=tuple(
                sorted(
                    {
                        int(metadata[k])
                        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                        if k in metadata
                    }
                )
            ),
            dtype=_float_dtype(reader),
            raw=metadata,
        )
    except KeyError as exc:
        raise CheckpointError(f"{path} lacks the GGUF metadata key {arch}.{exc.args[0]}.") from None
    return config, metadata, permuted


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    if f"{arch}.rope.scaling.factor" in metadata:
        scaling["factor"] = float(metadata[f"{arch}.rope.scaling.factor"])
    if f"{arch}.rope.scaling.original_context_length" in metadata:
        scaling["original_max_position_embeddings"] = int(metadata[f"{arch}.rope.scaling.original_context_length"])
    return scaling


def _float_dtype(reader: Any) -> str:
    """The float type of the unquantized tensors: what weights default to once dequantized."""
    from gguf import GGMLQuantizationType as Q

    names = {Q.F32: "float32", Q.F16: "float16", Q.BF16: "bfloat16"}
    for tensor in reader.tensors:
        if tensor.tensor_type in names:
            return names[tensor.tensor_type]
    return "float32"


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for tensors fd does not use."""
    module, _, kind = gguf_name.rpartition(".")
    if module in _TOP_LEVEL:
        return f"{_TOP_LEVEL[module]}.{kind}"
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _PER_LAYER:
        layer, piece, kind = match.groups()
        return f"model.layers.{layer}.{_PER_LAYER[piece]}.{kind}"
    return None


def _reader_for(tensor: Any, permute_heads: int | None, keep: bool) -> Callable[[], HostWeight]:
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first

    def read() -> HostWeight:
        weight: HostWeight
        if keep:
            weight = gguf_quants.decode(tensor.tensor_type.name, tensor.data, shape)  # type: ignore[arg-type]
        elif tensor.tensor_type == Q.F32:
            weight = np.array(tensor.data, dtype=np.float32).reshape(shape)
        else:
            try:
                weight = dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError as exc:
                raise CheckpointError(
                    f"Tensor {tensor.name} is stored as {tensor.tensor_type.name}, which fd cannot dequantize."
                ) from exc
            weight = weight.astype(np.float32, copy=False).reshape(shape)
        if permute_heads is not None:
            order = unpermute_rotary_rows(np.arange(shape[0]), permute_heads)
            weight = permute_rows(weight, order)
        return weight if isinstance(weight, QuantizedWeight) else np.ascontiguousarray(weight)

    return read


# -- tokenizer ----------------------------------------------------------------------------------


def _array(reader: Any, key: str) -> list[Any] | None:
    field = reader.fields.get(key)
    return None if field is None else list(field.contents())


def gguf_tokenizer(reader: Any, metadata: dict[str, Any], path: Path) -> TextTokenizer:
    """The tokenizer the metadata describes, built as transformers builds it from the same file."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = metadata.get("tokenizer.ggml.model")
    tokens = _array(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"{path} has no tokenizer.ggml.tokens; fd needs the tokenizer inside the GGUF.")
    types = _array(reader, "tokenizer.ggml.token_type") or []
    merges_raw = _array(reader, "tokenizer.ggml.merges")
    merges = [tuple(merge.split(" ", 1)) for merge in merges_raw] if merges_raw is not None else None

    if kind == "gpt2":
        spelling = byte_alphabet()
        alphabet = set(spelling.values())
        # Vocabularies are written in the byte alphabet; respell any token stored as raw text.
        vocab = {
            token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)
        }
        backend = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges or [],
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        pre = metadata.get("tokenizer.ggml.pre")
        split = _SPLITS.get(pre)
        if pre in _DIGITS_FIRST:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
            )
        elif split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        # A control token outside the byte alphabet is a converter mislabel, not a real token.
        control = (t for t, k in zip(tokens, types, strict=False) if k == CONTROL and set(t) <= alphabet)
        add_special_tokens(backend, control)
        known = backend.get_vocab()
        add_plain_tokens(backend, [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in known])
        default_add_bos = False
    elif kind == "llama":
        scores = _array(reader, "tokenizer.ggml.scores")
        if merges is None and scores is None:
            raise CheckpointError(f"{path} has neither merges nor scores for its sentencepiece vocabulary.")
        backend = sentencepiece_bpe(tokens, types, scores=scores, merges=merges)
        default_add_bos = True  # llama.cpp's default for sentencepiece vocabularies
    else:
        raise CheckpointError(f"{path} uses a '{kind}' tokenizer, which fd cannot build (gpt2 and llama only).")

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    unk, pad = token("unknown_token_id"), token("padding_token_id")
    add_special_tokens(backend, [bos, eos, unk, pad])
    set_bos_eos(
        backend,
        bos,
        eos,
        bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
    )
    eot = metadata.get("tokenizer.ggml.eot_token_id")
    return TextTokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        extra_eos_ids=[int(eot)] if eot is not None else [],
        chat_template=metadata.get("tokenizer.chat_template"),
    )


# -- the checkpoint ---------------------------------------------------------------------------


def load_gguf(path: Path, tokenizer: bool = True) -> Checkpoint:
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError, struct errors, OSError...
        raise CheckpointError(f"Cannot read {path} as GGUF: {exc}.") from exc
    config, metadata, permuted = gguf_config(reader, path)
    text_tokenizer = gguf_tokenizer(reader, metadata, path) if tokenizer else None
    found: dict[str, tuple[int, ...]] = {}
    readers: dict[str, Callable[[], HostWeight]] = {}
    plain = {"F32", "F16", "BF16"}
    dequantized: Counter[str] = Counter()
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        heads = None
        # Biases were permuted along with their weights.
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads = config.num_attention_heads
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        found[name] = tuple(int(n) for n in reversed(tensor.shape))
        kind = tensor.tensor_type.name
        keep = kind in gguf_quants.KEPT and len(found[name]) == 2
        if kind not in plain and not keep:
            dequantized[kind] += 1
        readers[name] = _reader_for(tensor, heads, keep)
    for kind, count in sorted(dequantized.items()):
        log.info("%s: %d tensor(s) of type %s dequantized to float32 (fd keeps %s quantized)", path.name, count,
                 kind, ", ".join(sorted(gguf_quants.KEPT)))
    names = select_weights(config, found, path)
    return Checkpoint(
        path=path,
        format="gguf",
        config=config,
        tokenizer=text_tokenizer,
        readers={name: readers[name] for name in names},
    )
