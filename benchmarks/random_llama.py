"""Write a random-weight Llama checkpoint (bfloat16 safetensors) that speaks through the default
model's tokenizer and chat template, for benchmarks that need a model larger than SmolLM2-135M
and no download: the figures depend on the shapes, not on what the weights say.

    python benchmarks/random_llama.py OUT [--hidden 2048] [--intermediate 8192] [--layers 16]

``--hidden 2048 --layers 16`` is about 1.2B parameters, ``--hidden 3072 --layers 28`` about 3.1B
(32 query heads, 8 key-value heads, SmolLM2's 49,152-token vocabulary, untied LM head).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from fd_core.loader import load_checkpoint, resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokenizer-of", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    args = ap.parse_args()
    h, inter, heads, kv = args.hidden, args.intermediate, args.heads, args.kv_heads
    d = h // heads
    tok = load_checkpoint(resolve_model(args.tokenizer_of)).tokenizer
    vocab = tok.vocab_size
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)

    def mat(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=gen, device=device) * (gain / cols**0.5)
        return w.to(torch.bfloat16).cpu()

    def ones() -> torch.Tensor:
        return torch.ones(h, dtype=torch.bfloat16)

    weights = {"model.embed_tokens.weight": mat(vocab, h, 8.0), "model.norm.weight": ones(),
               "lm_head.weight": mat(vocab, h)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": mat(heads * d, h), p + "self_attn.k_proj.weight": mat(kv * d, h),
            p + "self_attn.v_proj.weight": mat(kv * d, h), p + "self_attn.o_proj.weight": mat(h, heads * d),
            p + "mlp.gate_proj.weight": mat(inter, h), p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
            p + "input_layernorm.weight": ones(), p + "post_attention_layernorm.weight": ones(),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
        "vocab_size": vocab, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": args.layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}, indent=1))
    tok.backend.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "chat_template": tok.chat_template}))
    print(f"{args.out}: {sum(w.numel() for w in weights.values()) / 1e9:.2f}B parameters")


if __name__ == "__main__":
    main()
