"""What a quantized KV cache (``--kv-cache-dtype int8 | fp8_e4m3``) costs and buys: KV blocks in
the same memory, greedy agreement with the unquantized cache, perplexity. Prints figures;
asserts nothing about them (tests/test_kv_cache_quantization.py holds the bounds).

    python benchmarks/kv_cache_quality.py [--model M] [--device cpu] [--runtime torch]
        [--dtype bfloat16] [--prompts 32] [--tokens 64] [--kv-cache-dtype int8 fp8_e4m3]
        [--kv-cache-memory-gb G]

Prompts are consecutive 32-token slices of the shipped Austen text (tests/data), or random token
ids (``--random-prompts``, for random-weight models whose tokenizer knows no English), each
continued for ``--tokens`` greedy tokens in one batch, once per cache dtype (``auto``, the
model's dtype, first: the reference). Two agreements with the reference's continuations,
free-running (identical continuations, tokens before the first difference) and teacher-forced
(each position's greedy choice given the reference's history); see fd_core/bench/agreement.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from fd_core import LLM, SamplingParams
from fd_core.bench.agreement import free_running, teacher_forced
from fd_core.bench.perplexity import perplexity
from fd_core.loader import DEFAULT_MODEL

TEXT = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "data", "pride_and_prejudice_1-3.txt")


def austen_prompts(tokenizer, count: int, length: int = 32) -> list[list[int]]:
    with open(TEXT, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read())
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def random_prompts(vocab_size: int, count: int, length: int = 32) -> list[list[int]]:
    return np.random.default_rng(0).integers(3, vocab_size, (count, length)).tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runtime", default="torch")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype: the reference cache's")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--random-prompts", action="store_true", help="random token ids, not the Austen text")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-cache-dtype", nargs="+", default=["int8", "fp8_e4m3"])
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="the KV cache's size (default: the engine's: 2 GiB, or profiled where the backend can)")
    ap.add_argument("--window", type=int, default=512, help="perplexity window")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()

    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows, reference, prompts = [], None, None
    for kv in ["auto", *args.kv_cache_dtype]:
        start = time.perf_counter()
        llm = LLM(model=args.model, device=args.device, runtime=args.runtime, dtype=args.dtype,
                  kv_cache_dtype=kv, max_model_len=1024, max_num_seqs=args.prompts,
                  kv_cache_memory_gb=args.kv_cache_memory_gb)
        tokenizer = llm.get_tokenizer()
        if prompts is None:
            prompts = (random_prompts(llm.engine.model_config.vocab_size, args.prompts) if args.random_prompts
                       else austen_prompts(tokenizer, args.prompts))
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        reference = reference or outs
        identical, prefix = free_running(reference, outs)
        with open(TEXT, encoding="utf-8") as f:
            ppl, scored = perplexity(llm, tokenizer.encode(f.read()), args.window)
        row = {"kv_cache_dtype": llm.engine.config.cache_dtype, "blocks": llm.engine.pool.num_blocks,
               "identical": identical, "prefix": prefix,
               "teacher_forced": teacher_forced(llm, prompts, reference), "perplexity": ppl,
               "seconds": time.perf_counter() - start}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        del llm

    print(f"\n{args.model} on {args.device} ({args.runtime}), model dtype {args.dtype}, {args.prompts} prompts x "
          f"{args.tokens} greedy tokens, perplexity over {scored} tokens ({platform.processor() or platform.machine()})")
    print("| KV cache | blocks | identical continuations | tokens before first difference | teacher-forced "
          "agreement | perplexity |")
    print("|---|---|---|---|---|---|")
    base = rows[0]
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['blocks']} ({r['blocks'] / base['blocks']:.2f}x) | {r['identical']:.0%} | "
              f"{r['prefix']:.1%} | {r['teacher_forced']:.1%} | {r['perplexity']:.3f} "
              f"({r['perplexity'] / base['perplexity'] - 1:+.2%}) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
