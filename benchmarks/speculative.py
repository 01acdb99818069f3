"""Speculative decoding's speed (issue 19), two measurements:

``quote`` (the default): n-gram proposals on a repetitive load — each prompt quotes a passage of
*Pride and Prejudice* (tests/data, public domain) and asks for it back — at each ``--batch``,
beside the same engine without speculation, same prompts and lengths (``ignore_eos``, exactly
``--tokens`` tokens a row). The time per output token is ``(t(N) - t(1)) / (N - 1)``, the
prefill taken out, the runs alternated and their medians compared; the acceptance rate (accepted
drafts over drafts verified) and the mean tokens a sequence gets from a verifying step are
printed beside it.

``step-cost``: what one verification step costs against a plain decode step, for a target and a
draft model of the same shape with fewer layers (random weights: ``--load-format dummy``, so
every draft is rejected and each step emits one token): the mean step time at each ``--batch``,
with and without speculation, and the per-draft acceptance rate at which speculation would
break even (the expected tokens a step emits, ``(1 - a^(k+1)) / (1 - a)``, equal to the cost
ratio).

    python benchmarks/speculative.py [--device cpu|cuda] [--batch 1 32] [--tokens 512] [--k 4]
    python benchmarks/speculative.py step-cost --device cuda [--shape ernie-0.3b] [--draft-layers 2]

Figures: docs/PERFORMANCE.md, "Speculative decoding".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fd_core import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "pride_and_prejudice_1-3.txt"


def passages(count: int, words: int = 420) -> list[str]:
    """``count`` distinct passages of about ``words`` words (about 550 of SmolLM2's tokens)."""
    body = TEXT.read_text(encoding="utf-8").split("\n", 2)[2].split()
    step = max(1, (len(body) - words) // max(1, count))
    return [" ".join(body[i * step : i * step + words]) for i in range(count)]


def quote_chats(count: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Repeat the following passage exactly, word for word.\n\n{p}"}]
            for p in passages(count)]


def timed(llm: LLM, chats: list, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return time.perf_counter() - start


def quote(args: argparse.Namespace) -> dict:
    # two engines share the device: each a KV cache of a fixed size, not a share of what is free
    engine = dict(device=args.device, max_model_len=2048, max_num_seqs=max(args.batch), dtype=args.dtype,
                  kv_cache_memory_gb=2.0)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    report = {"model": args.model, "device": args.device, "speculative_config": spec, "tokens": args.tokens,
              "batches": {}}
    llms = {"plain": LLM(args.model, **engine), "ngram": LLM(args.model, speculative_config=spec, **engine)}
    for batch in args.batch:
        chats = quote_chats(batch)
        for llm in llms.values():  # warm-up: the first run compiles and allocates
            timed(llm, chats, 8)
        times = {name: {"full": [], "first": []} for name in llms}
        stats0 = dict(llms["ngram"].engine.stats)
        for _ in range(args.repeats):
            for name, llm in llms.items():
                times[name]["full"].append(timed(llm, chats, args.tokens))
                times[name]["first"].append(timed(llm, chats, 1))
        s = llms["ngram"].engine.stats
        drafts = s["spec_draft_tokens"] - stats0["spec_draft_tokens"]
        accepted = s["spec_accepted_tokens"] - stats0["spec_accepted_tokens"]
        verifying = s["spec_drafts"] - stats0["spec_drafts"]
        row = {}
        for name in llms:
            full, first = statistics.median(times[name]["full"]), statistics.median(times[name]["first"])
            row[f"{name}_ms_per_token"] = (full - first) / (args.tokens - 1) * 1e3
            row[f"{name}_runs_s"] = times[name]["full"]
        row["speedup"] = row["plain_ms_per_token"] / row["ngram_ms_per_token"]
        row["acceptance_rate"] = accepted / drafts if drafts else 0.0
        row["tokens_per_verifying_step"] = 1 + accepted / verifying if verifying else 1.0
        report["batches"][batch] = row
        print(f"batch {batch}: plain {row['plain_ms_per_token']:.2f} ms/token, ngram k={args.k} "
              f"{row['ngram_ms_per_token']:.2f} ms/token ({row['speedup']:.2f}x), acceptance "
              f"{row['acceptance_rate']:.1%}, {row['tokens_per_verifying_step']:.2f} tokens a verifying step",
              flush=True)
    return report


def step_cost(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests import checkpoints

    from transformers import Ernie4_5Config

    tmp = Path(tempfile.mkdtemp(prefix="fd-spec-"))
    shape = dict(checkpoints.ERNIE_45_03B)
    target = checkpoints.make_config_only(tmp, Ernie4_5Config, "target", **shape)
    draft = checkpoints.make_config_only(tmp, Ernie4_5Config, "draft", **{**shape, "num_hidden_layers": args.draft_layers})
    engine = dict(device=args.device, load_format="dummy", max_model_len=2048, max_num_seqs=max(args.batch),
                  dtype=args.dtype, kv_cache_memory_gb=2.0)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k}
    llms = {"plain": LLM(str(target), **engine), "draft": LLM(str(target), speculative_config=spec, **engine)}
    report = {"shape": shape, "draft_layers": args.draft_layers, "k": args.k, "batches": {}}
    for batch in args.batch:
        prompts = [[5 + (i * 7 + j) % 1000 for j in range(128)] for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        row = {}
        for name, llm in llms.items():
            llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
            runs = []
            for _ in range(args.repeats):
                steps0 = llm.engine.stats["steps"]
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                first = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
                prefill = time.perf_counter() - first
                steps = llm.engine.stats["steps"] - steps0 - 2  # less the two prefill steps
                runs.append(((first - start) - prefill) / max(1, steps) * 1e3)
            row[f"{name}_ms_per_step"] = statistics.median(runs)
        ratio = row["draft_ms_per_step"] / row["plain_ms_per_step"]
        row["cost_ratio"] = ratio
        # per-draft acceptance a at which (1 - a^(k+1)) / (1 - a) = ratio, by bisection
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            tokens = sum(mid**j for j in range(args.k + 1))
            lo, hi = (mid, hi) if tokens < ratio else (lo, mid)
        row["break_even_acceptance"] = lo if ratio <= args.k + 1 else None
        report["batches"][batch] = row
        print(f"batch {batch}: decode step {row['plain_ms_per_step']:.3f} ms, verification step with a "
              f"{args.draft_layers}-layer draft and k={args.k} {row['draft_ms_per_step']:.3f} ms ({ratio:.2f}x); "
              f"break-even acceptance {row['break_even_acceptance']}", flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", default="quote", choices=("quote", "step-cost"))
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args) | {"json": str(args.json)}}
    report |= quote(args) if args.what == "quote" else step_cost(args)
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
