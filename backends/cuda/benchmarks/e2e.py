"""fd on the cuda backend beside transformers' ``generate()``, same GPU, same random-weight model
shaped like ERNIE-4.5-0.3B (18 layers, hidden 1024, 16 query / 2 key-value heads of 128,
intermediate 3072, vocabulary 103,424, tied embeddings), bfloat16, greedy.

    python backends/cuda/benchmarks/e2e.py [--model DIR] [--no-sync] [--no-eager] [--skip-hf]
        [--num-scheduler-steps K [K ...]]

Prints, for transformers, fd as it runs by default (CUDA graphs, asynchronous scheduling), fd
with graphs but ``async_scheduling=False``, and fd with ``enforce_eager``:
  * batch 1, 128-token prompt: time per output token (mean over decode steps), beside the HBM
    roofline (weight bytes + KV bytes read per token / the GPU's memory bandwidth);
  * 128 requests of 1,024 prompt tokens, 128 output tokens each, submitted at once: output
    tokens/s over the whole run (prefill included), the median of ``--repeats`` runs (each
    run's figure is kept too: both sides are partly bound by the host's CPU, whose speed varies
    between runs on a shared machine), and the ratio fd / transformers.
transformers runs first and is released before fd loads, so both have the GPU to themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.checkpoints import ERNIE_45_03B  # noqa: E402

# Peak HBM bandwidth by product name (datasheets), for the roofline line only.
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}



def build_model(folder: Path) -> Path:
    from tests import checkpoints

    if (folder / "ernie45" / "config.json").exists():
        return folder / "ernie45"
    path = checkpoints.make_ernie45(folder, **ERNIE_45_03B)
    whole_vocabulary_tokenizer(path, ERNIE_45_03B["vocab_size"])
    return path


def whole_vocabulary_tokenizer(folder: Path, vocab_size: int) -> None:
    """Replace the test tokenizer (a few hundred pieces) by a word-level one that names every
    id of the model's vocabulary (``<unk>``, ``<s>``, ``</s>``, ``fd bench serve``'s words, then
    ``w...``), so every token a random model samples decodes to text: the serving benchmark
    counts streams by content."""
    from fd_core.bench.serve import WORDS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # the benchmark's own words first, so its prompts are distinct token sequences
    names = list(dict.fromkeys(WORDS)) + [f"w{i}" for i in range(vocab_size)]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for name in names:
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(name, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer.model").unlink(missing_ok=True)


def bandwidth() -> tuple[str, float | None]:
    name = torch.cuda.get_device_name(0)
    for key, value in HBM_BYTES_PER_S.items():
        if key in name:
            return name, value
    return name, None


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, ERNIE_45_03B["vocab_size"], size=(count, length)).tolist()


# -- transformers -------------------------------------------------------------------------------


def timed_generate(model, batch, new: int) -> float:
    """Seconds for transformers' greedy ``generate()`` of exactly ``new`` tokens after each row
    of ``batch`` (token ids, equal lengths), on the GPU."""
    ids = torch.tensor(batch, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def hf_run(model_dir: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).cuda().eval()
    out = {}

    def generate(batch: list[list[int]], new: int) -> float:
        return timed_generate(model, batch, new)

    one = prompts(1, 128, 1)
    generate(one, 8)  # warm-up
    first, full = generate(one, 1), generate(one, args.decode_tokens + 1)
    out["batch1_ms_per_token"] = (full - first) / args.decode_tokens * 1e3
    many = prompts(args.requests, args.prompt_len, 2)
    generate(many, 4)  # untimed, at full size: its first full batch costs transformers far more
    walls = [generate(many, args.output_len) for _ in range(args.repeats)]
    wall = float(np.median(walls))
    out["throughput_tokens_per_s"] = args.requests * args.output_len / wall
    out["throughput_wall_s"] = wall
    out["throughput_tokens_per_s_each"] = [args.requests * args.output_len / w for w in walls]
    model = None  # released before fd loads
    gc.collect()
    torch.cuda.empty_cache()
    return out


# -- fd -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def profiled(enabled: bool, title: str):
    """cProfile the block and print where the host's time went (``--profile``)."""
    if not enabled:
        yield
        return
    profile = cProfile.Profile()
    profile.enable()
    try:
        yield
    finally:
        profile.disable()
        print(f"--- host profile: {title}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def batch1(engine, prompt: list[int], params) -> dict:
    """One request alone: the mean and median time per token between its first and last. No
    synchronisation: a token is timed when it reaches the host (with asynchronous scheduling
    the next step is already queued then). A step that brings several tokens (a round of
    ``--num-scheduler-steps``) counts its gap once per token, divided among them."""
    engine.add_request("b1", prompt, params)
    stamps, counts = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs:
            stamps.append(time.perf_counter())
            counts.append(len(outputs[0].outputs[0].token_ids))
    gaps, tokens = np.diff(stamps), np.diff(counts)
    per_token = np.repeat(gaps / tokens, tokens)
    return {"batch1_ms_per_token": float(gaps.sum() / tokens.sum()) * 1e3,
            "batch1_ms_per_token_p50": float(np.median(per_token)) * 1e3}


def fd_run(model_dir: Path, args, enforce_eager: bool, async_scheduling: bool | None = None,
           num_scheduler_steps: int = 1) -> dict:
    from fd_core import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device="cuda", dtype="bfloat16", max_model_len=args.prompt_len + args.output_len + 64,
              max_num_seqs=args.requests, enforce_eager=enforce_eager, async_scheduling=async_scheduling,
              gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_dtype=args.kv_cache_dtype,
              num_scheduler_steps=num_scheduler_steps)
    engine = llm.engine
    out = {"kv_cache_blocks": engine.core.pool.num_blocks if hasattr(engine.core.pool, "num_blocks") else None}

    greedy = SamplingParams(temperature=0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
    # warm-up: compile the kernels, capture the graphs of the sizes used below
    llm.generate(prompts(4, 128, 3), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)

    with profiled(args.profile, "batch 1"):
        out.update(batch1(engine, prompts(1, 128, 1)[0], greedy))

    many = prompts(args.requests, args.prompt_len, 2)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # an identical untimed run first: every kernel variant the load needs is compiled then
    llm.generate(many, params, use_tqdm=False)
    walls = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # each timed run computes every prompt
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profiled(args.profile, "throughput"):
            results = llm.generate(many, params, use_tqdm=False)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
        assert sum(len(r.outputs[0].token_ids) for r in results) == args.requests * args.output_len
    wall = float(np.median(walls))
    out["throughput_tokens_per_s"] = args.requests * args.output_len / wall
    out["throughput_wall_s"] = wall
    out["throughput_tokens_per_s_each"] = [args.requests * args.output_len / w for w in walls]
    out["steps"] = engine.core.stats["steps"]
    out["rounds"] = engine.core.stats["rounds"]
    engine.core.shutdown()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def roofline(model_dir: Path, context: int) -> dict:
    """Bytes a decode step must read at batch 1: every weight once (tied embedding: the LM head
    is the embedding table; the embedding lookup reads one row) and the KV cache so far."""
    c = ERNIE_45_03B
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
    weights = (c["num_hidden_layers"] * per_layer + c["vocab_size"] * h) * 2  # bfloat16
    kv_bytes = c["num_hidden_layers"] * 2 * kv * context * 2
    name, bw = bandwidth()
    return {"gpu": name, "weight_bytes": weights, "kv_bytes_at_context": kv_bytes,
            "hbm_bytes_per_s": bw, "roofline_ms_per_token": (weights + kv_bytes) / bw * 1e3 if bw else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/fd-ernie-0.3b"))
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--kv-cache-dtype", default="auto", help="fd's KV cache: auto (bfloat16), int8, fp8_e4m3")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of the throughput load; the median is reported")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True, help="also run fd without graphs")
    ap.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                    help="also run fd with graphs but without asynchronous scheduling")
    ap.add_argument("--profile", action="store_true", help="cProfile fd's timed runs")
    ap.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1], metavar="K",
                    help="run fd (graphs, asynchronous) once per K: rounds of K decode steps (default: 1)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    model_dir = build_model(args.model)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
              "args": {k: str(v) for k, v in vars(args).items()},
              "roofline": roofline(model_dir, 128 + args.decode_tokens // 2)}
    if not args.skip_hf:
        report["transformers"] = hf_run(model_dir, args)
        print("transformers", report["transformers"], flush=True)
    runs = []
    for k in args.num_scheduler_steps:
        key = "fd_graphs" if k == 1 else f"fd_graphs_steps{k}"
        report[key] = fd_run(model_dir, args, enforce_eager=False, num_scheduler_steps=k)
        print(f"fd (CUDA graphs, --num-scheduler-steps {k})", report[key], flush=True)
        runs.append(key)
    if args.sync:
        report["fd_graphs_sync"] = fd_run(model_dir, args, enforce_eager=False, async_scheduling=False)
        print("fd (CUDA graphs, --no-async-scheduling)", report["fd_graphs_sync"], flush=True)
    if args.eager:
        report["fd_eager"] = fd_run(model_dir, args, enforce_eager=True)
        print("fd (eager)", report["fd_eager"], flush=True)
    if "transformers" in report:
        hf = report["transformers"]["throughput_tokens_per_s"]
        for key in [k for k in (*runs, "fd_graphs_sync", "fd_eager") if k in report]:
            report[key]["throughput_vs_transformers"] = report[key]["throughput_tokens_per_s"] / hf
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
