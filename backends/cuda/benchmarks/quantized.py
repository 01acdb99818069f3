"""Weight-only quantization on the GPU: a random-weight model of Llama-3-8B's width (hidden 4096,
MLP 14336, 32 query / 8 key-value heads of 128, vocabulary 128,256, untied), bfloat16
activations, loaded plain and with ``--quantization wint8 / wint4 / fp8``.

    python backends/cuda/benchmarks/quantized.py [--layers 32] [--methods none wint8 wint4 fp8]

For each: the GPU memory the weights take, batch-1 time per output token (128-token prompt,
``--decode-tokens`` greedy tokens, mean and median of the steps) beside its HBM roofline (the
bytes of every weight the step reads, the LM head included, plus the KV cache read, over the
GPU's bandwidth), and output tokens/s of ``--requests`` requests of ``--prompt-len`` tokens and
``--output-len`` new tokens submitted at once. The checkpoint is written once (bfloat16
safetensors, random normal weights of std 0.02) into ``--model``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import bandwidth, batch1, whole_vocabulary_tokenizer  # noqa: E402

SHAPE = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
             head_dim=128, vocab_size=128256)


def build(folder: Path, layers: int) -> Path:
    from safetensors.torch import save_file

    from tests import checkpoints

    folder = folder / f"llama8b-{layers}"
    if (folder / "config.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    h, i, d, v = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["head_dim"], SHAPE["vocab_size"]
    q, kv = SHAPE["num_attention_heads"] * d, SHAPE["num_key_value_heads"] * d
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    save_file({"model.embed_tokens.weight": rand(v, h), "lm_head.weight": rand(v, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, str(folder / "model-head.safetensors"))
    for n in range(layers):
        p = f"model.layers.{n}."
        save_file({p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
                   p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
                   p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
                   p + "mlp.down_proj.weight": rand(h, i),
                   p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)},
                  str(folder / f"model-{n:03d}.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
              **{k: val for k, val in SHAPE.items()}}
    (folder / "config.json").write_text(json.dumps(config))
    checkpoints._byte_level_tokenizer(folder, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
                                      chat_template=checkpoints.LLAMA_TEMPLATE)
    # every id decodes to a word, so serve_latency.py --model can count this model's streams too
    whole_vocabulary_tokenizer(folder, v)
    return folder


def run(model: Path, method: str, args) -> dict:
    from fd_core import LLM, SamplingParams
    from fd_core.interfaces import QuantizedWeight

    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    llm = LLM(model=str(model), device="cuda", dtype="bfloat16", max_model_len=args.prompt_len + args.output_len + 64,
              max_num_seqs=args.requests, gpu_memory_utilization=0.85,
              quantization=None if method == "none" else method)
    out: dict = {"load_s": time.perf_counter() - t0}
    engine = llm.engine
    runner = engine.runner
    out["weight_bytes"] = runner.model.weight_bytes()
    down = runner.model.layers[0].down
    out["layout"] = down.layout if isinstance(down, QuantizedWeight) else "dense"
    vocab = SHAPE["vocab_size"]
    llm.generate(rng.integers(3, vocab, (4, 128)).tolist(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    out.update(batch1(engine, rng.integers(3, vocab, 128).tolist(),
                      SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)))
    many = rng.integers(3, vocab, (args.requests, args.prompt_len)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(many, params, use_tqdm=False)  # compiles every kernel variant of the load
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(many, params, use_tqdm=False)
    torch.cuda.synchronize()
    out["throughput_tokens_per_s"] = args.requests * args.output_len / (time.perf_counter() - t0)
    engine.core.shutdown()
    del llm, engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/fd-quantized"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--methods", nargs="+", default=["none", "wint8", "wint4", "fp8"])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = build(args.model, args.layers)
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s: {model}", flush=True)
    name, bw = bandwidth()
    h, d = SHAPE["hidden_size"], SHAPE["head_dim"]
    kv_read = args.layers * 2 * SHAPE["num_key_value_heads"] * d * (128 + args.decode_tokens // 2) * 2
    report = {"gpu": name, "hbm_bytes_per_s": bw, "layers": args.layers, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "torch": torch.__version__, "results": {}}
    for method in args.methods:
        r = run(model, method, args)
        # the step reads every weight but the embedding table (one row of it)
        read = r["weight_bytes"] - SHAPE["vocab_size"] * h * 2 + kv_read
        r["roofline_ms_per_token"] = read / bw * 1e3 if bw else None
        report["results"][method] = r
        print(method, json.dumps(r), flush=True)
    base = report["results"].get("none")
    if base:
        for method, r in report["results"].items():
            r["ms_per_token_vs_bf16"] = r["batch1_ms_per_token"] / base["batch1_ms_per_token"]
            r["throughput_vs_bf16"] = r["throughput_tokens_per_s"] / base["throughput_tokens_per_s"]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
