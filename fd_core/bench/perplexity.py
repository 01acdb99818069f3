"""Perplexity of an engine's model over a text: how much a weight or KV-cache format costs in
quality, measured on the model as the engine runs it (its ops, its quantized weights).

    python -m fd_core.bench.perplexity FILE [--window 1024] [engine flags as for fd generate]

The text is cut into windows of ``window`` tokens; each window is one prefill, and every token
of it but the first is scored given the ones before it in that window. The engine must be idle:
the windows run on its KV cache outside its scheduler, and its prefix cache is emptied after.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import numpy as np

from fd_core.engine.model_runner import prefill_batch, prepare_inputs


def prompt_logits(llm: Any, token_ids: list[int]) -> np.ndarray:
    """The logits after every token of ``token_ids`` (``[len - 1, vocab]``, the last token's
    left out), from one prefill on the engine's model."""
    engine = llm.engine
    if engine.config.tensor_parallel_size > 1:
        raise ValueError("perplexity runs on one rank: use tensor_parallel_size 1")
    if engine.has_unfinished_requests():
        raise ValueError("the engine is serving requests: their KV blocks would be overwritten")
    runner = engine.runner
    scheduled = prefill_batch([token_ids], runner.block_size)
    needed = 1 + len(scheduled[0].seq.block_table)
    if needed > engine.pool.num_blocks:
        raise ValueError(f"a window of {len(token_ids)} tokens needs {needed} KV blocks, the cache has "
                         f"{engine.pool.num_blocks}: use a smaller window")
    inputs, _ = prepare_inputs(scheduled, runner.block_size)
    inputs.logit_rows = np.arange(len(token_ids) - 1, dtype=np.int64)
    logits = engine.memory.to_numpy(runner.run(inputs, eager=True))
    # the prefill wrote blocks 1.. behind the prefix cache's back: forget what they held
    engine.pool.reset_prefix_cache()
    return logits


def token_logprobs(llm: Any, token_ids: list[int]) -> np.ndarray:
    """``log p(token_ids[i + 1] | token_ids[: i + 1])`` for every ``i``, from one prefill."""
    logits = prompt_logits(llm, token_ids).astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(axis=-1))
    targets = np.asarray(token_ids[1:])
    return logits[np.arange(len(targets)), targets] - log_norm


def perplexity(llm: Any, token_ids: list[int], window: int = 1024) -> tuple[float, int]:
    """``(perplexity, tokens scored)`` over ``token_ids`` in windows of ``window`` tokens."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    window = min(window, llm.engine.config.max_model_len)
    scores = [token_logprobs(llm, token_ids[start:start + window])
              for start in range(0, len(token_ids) - 1, window) if len(token_ids[start:start + window]) > 1]
    everything = np.concatenate(scores)
    return math.exp(-everything.mean()), len(everything)


def main(argv: list[str] | None = None) -> int:
    from fd_core import LLM
    from fd_core.entrypoints.cli import add_engine_args, engine_config

    parser = argparse.ArgumentParser(prog="python -m fd_core.bench.perplexity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="a UTF-8 text file")
    parser.add_argument("--window", type=int, default=1024, help="tokens per prefill (default %(default)s)")
    add_engine_args(parser)
    args = parser.parse_args(argv)
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    llm = LLM.from_config(engine_config(args))
    ids = llm.get_tokenizer().encode(text)
    value, count = perplexity(llm, ids, args.window)
    print(f"perplexity {value:.4f} over {count} tokens (window {args.window})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
