"""Hugging Face model folders: ``config.json``, ``*.safetensors``, and the tokenizer files beside them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from fd_core.errors import CheckpointError
from fd_core.loader import fp8_checkpoint
from fd_core.loader.checkpoint import Checkpoint, canonical_architecture, select_weights
from fd_core.loader.safetensors_io import SafetensorsSet
from fd_core.loader.tokenizer import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    TextTokenizer,
    add_plain_tokens,
    add_special_tokens,
    sentencepiece_bpe,
    set_bos_eos,
)
from fd_core.models.config import ModelConfig

# model_type -> architecture, for configs that do not list ``architectures``.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM"}
_ERNIE = ("Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM")

# What transformers assumes when a config leaves a key out, per architecture.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
    "Qwen3ForCausalLM": {
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "head_dim": 128,
    },
    "Ernie4_5ForCausalLM": {
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "head_dim": 128,
    },
    # no head_dim default: transformers takes hidden / heads
    "Qwen3MoeForCausalLM": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768},
    "Ernie4_5_MoeForCausalLM": {"rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072},
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"Cannot read {path}: {exc}.") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} does not hold a JSON object.")
    return value


def read_optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def token_ids(value: Any) -> list[int]:
    """An ``eos_token_id``-style field (absent, an int or a list of ints) as a list."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(item) for item in value if item is not None]
    return [int(value)]


def architecture_of(config: Mapping[str, Any], source: Path) -> str:
    names = config.get("architectures") or []
    if names:
        return canonical_architecture(names[0], source)
    model_type = config.get("model_type")
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    return canonical_architecture(str(model_type or "an unnamed architecture"), source)


def rope_settings(config: Mapping[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from either ``rope_theta`` + ``rope_scaling`` or transformers-5 ``rope_parameters``."""
    params = config.get("rope_parameters")
    scaling = dict(params) if isinstance(params, Mapping) else dict(config.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = config.get("rope_theta", default_theta)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if not scaling or scaling == {"rope_type": "default"}:
        return float(theta), None
    return float(theta), scaling


def model_config(
    config: Mapping[str, Any],
    source: Path,
    *,
    architecture: str,
    dtype: str,
    eos_token_ids: Iterable[int] = (),
    bos_token_id: int | None = None,
    head_dim_default: int | None = None,
) -> ModelConfig:
    """Normalise a Hugging Face-style config dict (Paddle's uses the same keys) into ModelConfig."""
    defaults = _DEFAULTS[architecture]
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or head_dim_default or defaults.get("head_dim") or hidden // heads
        theta, scaling = rope_settings(config, defaults["rope_theta"])
        if architecture in _ERNIE:
            attention_bias = o_bias = mlp_bias = bool(config.get("use_bias", False))
        else:
            attention_bias = o_bias = bool(config.get("attention_bias", False))
            mlp_bias = bool(config.get("mlp_bias", False)) if architecture == "LlamaForCausalLM" else False
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", defaults["rms_norm_eps"])),
            rope_theta=theta,
            max_position_embeddings=int(config.get("max_position_embeddings", defaults["max_position_embeddings"])),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", architecture in _ERNIE)),
            attention_bias=attention_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            rope_scaling=scaling,
            bos_token_id=config.get("bos_token_id", bos_token_id),
            eos_token_ids=tuple(sorted(set(eos_token_ids))),
            dtype=dtype,
            raw=dict(config),
        )
    except KeyError as exc:
        raise CheckpointError(f"{source / 'config.json'} lacks the key {exc.args[0]!r}.") from None
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{source / 'config.json'} has a malformed value: {exc}.") from None


# -- tokenizer ----------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config stores it: a string or a serialised AddedToken."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_templates(folder: Path, tokenizer_config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template(s), with the priority transformers gives them.

    A ``chat_template.jinja`` file beats the ``chat_template`` key of tokenizer_config.json;
    ``additional_chat_templates/*.jinja`` add named ones; a list in tokenizer_config holds
    ``{"name", "template"}`` pairs; processor-style ``chat_template.json`` comes last.
    """
    named: dict[str, str] = {}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        named["default"] = jinja.read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for file in sorted(extra.glob("*.jinja")):
            named[file.stem] = file.read_text(encoding="utf-8")
    if named:
        return named["default"] if list(named) == ["default"] else named
    value = tokenizer_config.get("chat_template")
    if isinstance(value, list):
        return {item["name"]: item["template"] for item in value}
    if isinstance(value, str):
        return value
    legacy = folder / "chat_template.json"
    if legacy.is_file():
        template = read_json(legacy).get("chat_template")
        if isinstance(template, str):
            return template
    return None


def _piece_kind(processor: Any, index: int) -> int:
    if processor.is_control(index):
        return CONTROL
    if processor.is_unknown(index):
        return UNKNOWN
    if processor.is_byte(index):
        return BYTE
    return NORMAL


def sentencepiece_file(path: Path) -> Tokenizer:
    """A ``tokenizer.model`` (sentencepiece BPE) as the equivalent ``tokenizers`` pipeline."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # no protobuf: the processor API lacks the model type and user-defined pieces
        sentencepiece_model_pb2 = None
    if sentencepiece_model_pb2 is not None:
        proto = sentencepiece_model_pb2.ModelProto()
        try:
            proto.ParseFromString(path.read_bytes())
        except Exception as exc:  # protobuf raises its own DecodeError
            raise CheckpointError(f"Cannot read the sentencepiece model {path}: {exc}.") from exc
        if proto.trainer_spec.model_type != 2:  # 2 is BPE
            raise CheckpointError(f"{path} is a non-BPE sentencepiece model, which fd cannot load yet.")
        tokens = [piece.piece for piece in proto.pieces]
        kinds = [piece.type for piece in proto.pieces]
    else:
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
        tokens = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
        kinds = [_piece_kind(processor, i) for i in range(len(tokens))]
    # transformers orders the recovered merges by token id here, not by score.
    return sentencepiece_bpe(tokens, kinds)


def _add_with_id(backend: Tokenizer, text: str, index: int, special: bool, folder: Path) -> None:
    if backend.token_to_id(text) is None:
        (add_special_tokens if special else add_plain_tokens)(backend, [text])
    if backend.token_to_id(text) != index:
        raise CheckpointError(
            f"The tokenizer files in {folder} disagree on the id of {text!r}: {index} in the config, "
            f"{backend.token_to_id(text)} in the vocabulary."
        )


def load_tokenizer(
    folder: Path,
    config: Mapping[str, Any],
    generation_config: Mapping[str, Any],
) -> TextTokenizer:
    tokenizer_config = read_optional_json(folder / "tokenizer_config.json")
    special_map = read_optional_json(folder / "special_tokens_map.json")
    from_json = (folder / "tokenizer.json").is_file()
    if from_json:
        try:
            backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises plain Exception
            raise CheckpointError(f"Cannot read {folder / 'tokenizer.json'}: {exc}.") from exc
    elif (folder / "tokenizer.model").is_file():
        backend = sentencepiece_file(folder / "tokenizer.model")
    else:
        raise CheckpointError(f"{folder} has no tokenizer.json or tokenizer.model.")

    def special(name: str) -> str | None:
        return _token_text(tokenizer_config.get(name)) or _token_text(special_map.get(name))

    bos, eos, unk, pad = special("bos_token"), special("eos_token"), special("unk_token"), special("pad_token")

    # Tokens tokenizer_config (or added_tokens.json) lists with their ids, added as transformers adds them.
    declared = tokenizer_config.get("added_tokens_decoder") or {}
    for index, token in sorted(declared.items(), key=lambda item: int(item[0])):
        _add_with_id(backend, token["content"], int(index), token.get("special", True), folder)
    added_file = folder / "added_tokens.json"
    if added_file.is_file():
        for text, index in sorted(read_json(added_file).items(), key=lambda item: item[1]):
            _add_with_id(backend, text, int(index), False, folder)
    extras = tokenizer_config.get("additional_special_tokens") or tokenizer_config.get("extra_special_tokens") or []
    if isinstance(extras, Mapping):
        extras = list(extras.values())
    add_special_tokens(backend, [bos, eos, unk, pad, *(_token_text(item) for item in extras)])

    if not from_json:
        # Next to a tokenizer.json, transformers 5 drops these flags and keeps the file's
        # post-processor; for a sentencepiece model they decide BOS/EOS (both off by default).
        set_bos_eos(
            backend,
            bos,
            eos,
            bool(tokenizer_config.get("add_bos_token", False)),
            bool(tokenizer_config.get("add_eos_token", False)),
        )
    return TextTokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad,
        extra_eos_ids=token_ids(config.get("eos_token_id")) + token_ids(generation_config.get("eos_token_id")),
        chat_template=chat_templates(folder, tokenizer_config),
    )


# -- the checkpoint ---------------------------------------------------------------------------


@dataclass
class SafetensorsFolder:
    """What HF-layout and Paddle-layout folders share: the JSON configs, the tensors, the tokenizer."""

    folder: Path
    config_json: dict[str, Any]
    generation: dict[str, Any]
    architecture: str
    tensors: SafetensorsSet | None  # None: opened for its config and tokenizer alone
    tokenizer: TextTokenizer | None  # None: opened without it (skip_tokenizer_init)

    @classmethod
    def open(cls, folder: Path, tensors: bool = True, tokenizer: bool = True) -> "SafetensorsFolder":
        folder = Path(folder)
        config_json = read_json(folder / "config.json")
        generation = read_optional_json(folder / "generation_config.json")
        return cls(folder, config_json, generation, architecture_of(config_json, folder),
                   SafetensorsSet(folder) if tensors else None,
                   load_tokenizer(folder, config_json, generation) if tokenizer else None)

    def model_config(self, config_json: Mapping[str, Any] | None = None, dtype: str | None = None,
                     **kwargs: Any) -> ModelConfig:
        """``dtype``: what the weights are stored in (default: the tensors' own)."""
        if dtype is None:
            assert self.tensors is not None, "a folder opened without its tensors needs the dtype"
            dtype = self.tensors.stored_dtype()
        return model_config(
            self.config_json if config_json is None else config_json,
            self.folder,
            architecture=self.architecture,
            dtype=dtype,
            eos_token_ids=(self.tokenizer.eos_token_ids if self.tokenizer is not None else
                           token_ids(self.config_json.get("eos_token_id"))
                           + token_ids(self.generation.get("eos_token_id"))),
            bos_token_id=self.generation.get(
                "bos_token_id", self.tokenizer.bos_token_id if self.tokenizer is not None
                else self.config_json.get("bos_token_id")),
            **kwargs,
        )


def load_hf(folder: Path, tokenizer: bool = True) -> Checkpoint:
    """A Hugging Face folder: linear weights already ``[out, in]`` and named as transformers names them."""
    src = SafetensorsFolder.open(folder, tokenizer=tokenizer)
    config = src.model_config()
    tensors = src.tensors
    found = {name: tensors.shape(name) for name in tensors.names()}
    names = select_weights(config, found, src.folder)
    if fp8_checkpoint.quantization_method(src.config_json, src.folder):
        readers = {name: fp8_checkpoint.fp8_reader(tensors, name, found[name], src.folder) if len(found[name]) == 2
                   else (lambda name=name: tensors.read(name)) for name in names}
    else:
        readers = {name: (lambda name=name: tensors.read(name)) for name in names}
    extras = {name: (lambda name=name: tensors.read(name)) for name in found if name not in readers}
    return Checkpoint(path=src.folder, format="hf", config=config, tokenizer=src.tokenizer, readers=readers,
                      extras=extras)
