"""What JSON-schema decoding costs per output token (issue 18: at most 10% at batch 1 and 32),
and what compiling a schema costs, cold and cached.

Each batch runs twice with the same prompts, seeds and lengths: free text (``ignore_eos``) and
constrained by a JSON schema that cannot close within ``--tokens`` (an array of at least 1,000
objects of enums, bounded integers and short strings), so both produce exactly ``--tokens``
tokens per row and differ only by the grammar: its masks on the host, the bitmask in the
sample op. The time per output token is ``(t(N tokens) - t(1 token)) / (N - 1)``, the prefill
taken out, the two alternated and their medians compared; the host's mask time per step is
reported beside it (on a GPU it overlaps the step's forward). Where the backend defers the
mask (``deferred_bitmask``: the grammar thread fills it while the device holds the sample),
``--masks both`` also runs the JSON requests with the masks filled on the engine's thread, as
a backend without the op does, in the same alternation.

    python benchmarks/structured_output.py [--model M] [--device cpu|cuda] [--batch 1 32] [--tokens 64]
                                           [--masks both]

Figures: docs/PERFORMANCE.md, "Structured output".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from fd_core import LLM, SamplingParams
from fd_core.engine.structured import StructuredOutputsParams

ITEMS = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "status": {"enum": ["open", "closed", "pending"]},
    "label": {"type": "string", "maxLength": 16},
    "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["id", "status", "label", "score"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "minItems": 1000, "items": ITEMS}},
          "required": ["items"], "additionalProperties": False}
# for the compile times: distinct schemas of growing size
COMPILE = {
    "flat (2 fields)": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                        "required": ["name", "age"]},
    "the benchmark's (nested, enums, bounds)": SCHEMA,
    "wide (60 fields)": {"type": "object", "properties": {
        f"field_{i}": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 20},
                       {"enum": ["a", "b", "c"]}, {"type": "array", "items": {"type": "number"}}][i % 4]
        for i in range(60)}, "required": [f"field_{i}" for i in range(0, 60, 2)]},
}


def timed(llm: LLM, messages: list, params: list[SamplingParams]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.chat(messages, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def per_token(llm: LLM, batch: int, tokens: int, constrained: bool, repeats: int) -> tuple[float, int]:
    """Median seconds per output token at ``batch`` rows, and how many rows ran to ``tokens``."""
    messages = [[{"role": "user", "content": f"List {i + 3} open tickets as JSON."}] for i in range(batch)]
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None

    def params(n: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True, structured_outputs=so)
                for i in range(batch)]

    results, full = [], 0
    for _ in range(repeats):
        first, _ = timed(llm, messages, params(1))
        whole, outs = timed(llm, messages, params(tokens))
        full = sum(len(o.outputs[0].token_ids) == tokens for o in outs)
        results.append((whole - first) / (tokens - 1))
    return statistics.median(results), full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--masks", choices=["engine", "both"], default="engine",
                    help="both: JSON also with the masks on the engine's thread, where the engine defers them")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="the interpreter's thread switch interval in seconds (sys.setswitchinterval)")
    ap.add_argument("--grammar-threads", type=int, default=None,
                    help="threads of llguidance's pool that fill a step's masks (the engine uses 1)")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    print("compile (StructuredOutputsParams: the schema checked and translated, in the HTTP process):")
    StructuredOutputsParams(regex="warm-up")  # llguidance's import and first call, not a schema's cost
    for name, schema in COMPILE.items():
        start = time.perf_counter()
        StructuredOutputsParams(json=json.dumps(schema) + " ")  # a text no earlier call cached
        cold = time.perf_counter() - start
        start = time.perf_counter()
        StructuredOutputsParams(json=json.dumps(schema) + " ")
        print(f"  {name}: {cold * 1e3:.2f} ms cold, {(time.perf_counter() - start) * 1e3:.3f} ms cached")

    llm = LLM(args.model, device=args.device, max_num_seqs=max(args.batch), max_model_len=1024)
    core = llm.engine.core
    warm = [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=s)) for s in COMPILE.values()]
    llm.chat([[{"role": "user", "content": "hi"}]] * len(warm), warm, use_tqdm=False)  # the engine's templates
    grammars, worker = core.grammars, core._masks
    if args.grammar_threads is not None:
        from llguidance import LLExecutor

        grammars._executor = LLExecutor(num_threads=args.grammar_threads)
    where = "deferred to the grammar thread" if worker else "on the engine's thread"
    print(f"engine: {args.model} on {core.platform.name} ({core.platform.runtime}), async scheduling "
          f"{'on' if core.async_scheduling else 'off'}, masks {where}; llguidance tokenizer and {len(COMPILE)} templates "
          f"compiled in {grammars.compile_seconds * 1e3:.1f} ms (the templates), then copied per request")
    variants = [("json", worker)]
    if args.masks == "both" and worker is not None:
        variants = [("json, deferred", worker), ("json, inline", None)]
    print(f"{'batch':>5} {'variant':>15} {'ms/token':>9} {'overhead':>9} {'mask ms/step':>13} {'rows at N':>9}")
    for batch in args.batch:
        per_token(llm, batch, 8, False, 1)  # warm-up at this batch size
        # alternated, so that a slower spell of a shared machine falls on all
        frees, constraineds, masks = [], {v: [] for v, _ in variants}, {v: [] for v, _ in variants}
        full = {}
        for _ in range(args.repeats):
            frees.append(per_token(llm, batch, args.tokens, False, 1)[0])
            for name, masks_by in variants:
                core._masks = masks_by  # between requests: nothing in flight
                fills, seconds = grammars.fills, grammars.fill_seconds
                t, full[name] = per_token(llm, batch, args.tokens, True, 1)
                constraineds[name].append(t)
                masks[name].append((grammars.fill_seconds - seconds) / max(1, grammars.fills - fills))
            core._masks = worker
        free = statistics.median(frees)
        print(f"{batch:>5} {'free':>15} {free * 1e3:>9.2f}")
        for name, _ in variants:
            t, mask = statistics.median(constraineds[name]), statistics.median(masks[name])
            print(f"{batch:>5} {name:>15} {t * 1e3:>9.2f} {(t / free - 1) * 100:>8.1f}% {mask * 1e3:>13.3f} "
                  f"{full[name]:>5}/{batch}")


if __name__ == "__main__":
    main()
