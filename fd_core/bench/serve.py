"""``fd bench serve``: load any OpenAI-compatible server and measure what a user would feel.

Every request streams (SSE). From the client's clock we take, per request, the time to the first
content chunk (TTFT), the gaps between content chunks (ITL), the end-to-end latency (E2E) and
TPOT = (E2E - TTFT) / (output tokens - 1). Output tokens come from the final usage chunk when the
server sends one (``stream_options.include_usage``), otherwise from the number of content chunks.
Prompts are synthetic: words drawn from a fixed list with a seeded generator, so two servers see
the same text. The same code talks to fd's server and to llama.cpp's (``llama_cpp.server``).

Also runnable before the CLI hook exists: ``python -m fd_core.bench.serve --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

DEFAULT_BASE_URL = "http://127.0.0.1:8180"
PERCENTILES = (50, 90, 99)
SHOWN_ERRORS = 5

# Short, frequent English words: each is one token (with its leading space) in the usual BPE
# vocabularies, so N words make a prompt of roughly N tokens whatever the model.
WORDS = (
    "the of and to in is it that was for on are as with his they at be this from have or by one had "
    "not but what all were when we there can an your which their said if do will each about how up "
    "out them then she many some so these would other into has more her two like him see time could "
    "no make than first been its who now people my made over did down only way find use may water "
    "long little very after words called just where most know get through back much before go good "
    "new write our used me man too any day same right look think also around another came come work "
    "three word must because does part even place well such here take why things help put years "
    "different away again off went old number great tell men say small every found still between name "
    "should home big give air line set own under read last never us left end along while might next "
    "sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy "
    "once animals life enough took sometimes four head above kind began almost live page got earth "
    "need far hand high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days ever paper hard near sentence better best "
    "across during today others however sure means knew"
).split()


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    usage_seen: bool = False  # token counts came from the server, not from counting chunks
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() of each chunk


# ---------------------------------------------------------------------------------------------
# Workload


def make_prompts(n: int, input_len: int, seed: int | str) -> list[str]:
    """``n`` distinct prompts of ``input_len`` words each; the same seed gives the same prompts.
    Random words also keep servers with prefix caching from reusing one prompt's work for the next."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(max(1, input_len))) for _ in range(n)]


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each of ``n`` requests: exponential gaps (a Poisson process) at
    ``rate`` requests/s, or all zero for an infinite rate. A generator apart from the prompts' so
    that changing the rate does not change the prompts."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]


def build_body(endpoint: str, model: str, prompt: str, output_len: int, temperature: float,
               force_length: bool, extra_body: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": output_len, "temperature": temperature,
                            "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if force_length:
        # Not OpenAI fields, but vLLM, fd and llama-cpp-python read one or the other; servers that
        # know neither ignore them and may stop early, which the output token counts then show.
        body["ignore_eos"] = True
        body["min_tokens"] = output_len
        body["stream_options"] = {"include_usage": True}
    body.update(extra_body)
    return body


# ---------------------------------------------------------------------------------------------
# One streamed request


def _chunk_text(endpoint: str, chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        # Reasoning models stream their thinking first; it is output all the same.
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send_one(client: Any, path: str, body: dict[str, Any], endpoint: str,
                   fallback_prompt_tokens: int, result: RequestResult | None = None) -> RequestResult:
    """Stream one request. Filled in as chunks arrive into ``result`` when given, so a caller
    that cancels the call midway still has what came before."""
    result = result or RequestResult()
    result.prompt_tokens = fallback_prompt_tokens
    chunks = 0
    start = time.perf_counter()
    last = start
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace").strip()
            result.error = f"HTTP {response.status_code}: {text[:300]}"
            return result
        async for line in response.aiter_lines():
            # SSE: "data: ..." lines carry events; comments (": ping") and blank lines do not.
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                return result
            now = time.perf_counter()
            if _chunk_text(endpoint, chunk):
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                result.token_times.append(now)
            usage = chunk.get("usage")
            if usage:
                result.usage_seen = True
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                result.prompt_tokens = int(usage.get("prompt_tokens") or fallback_prompt_tokens)
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    result.cached_tokens = int(details["cached_tokens"])
    result.e2e = time.perf_counter() - start
    if chunks == 0:
        result.error = "the stream ended without any content"
        return result
    if not result.usage_seen:
        result.output_tokens = chunks
    result.ok = True
    return result


async def send_guarded(client: Any, path: str, body: dict[str, Any], endpoint: str,
                       fallback_prompt_tokens: int, timeout: float) -> RequestResult:
    """``send_one`` that never raises: a benchmark reports broken requests, it does not stop."""
    try:
        return await asyncio.wait_for(send_one(client, path, body, endpoint, fallback_prompt_tokens), timeout)
    except asyncio.TimeoutError:
        return RequestResult(error=f"timed out after {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - any failure of one request is a data point
        return RequestResult(error=f"{type(exc).__name__}: {exc}".strip())


# ---------------------------------------------------------------------------------------------
# Figures


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    if not values_s:
        # JSON has no NaN; None says "no data" (e.g. TPOT when every output had one token).
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [v * 1000.0 for v in values_s]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def _source(flags: list[bool]) -> str:
    if not flags:
        return "none"
    return "usage" if all(flags) else "chunks" if not any(flags) else "mixed"


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration,
        "requests_per_s": per_s(len(done)),
        "input_tokens_per_s": per_s(input_tokens),
        "output_tokens_per_s": per_s(output_tokens),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # "usage": counted by the server; "chunks": counted here, one token per content chunk
        # (and the prompt length is the requested word count).
        "token_counts_from": _source([r.usage_seen for r in done]),
        "ttft_ms": distribution_ms([r.ttft for r in done]),
        "tpot_ms": distribution_ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl]),
        "e2e_ms": distribution_ms([r.e2e for r in done]),
        "errors": [r.error for r in failed[:SHOWN_ERRORS]],
    }


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any], title: str) -> str:
    lines = [title]
    rows = [
        ("requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("requests/s", f"{summary['requests_per_s']:.2f}"),
        ("input tokens/s", f"{summary['input_tokens_per_s']:.2f}"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.2f}"),
        ("token counts from", summary["token_counts_from"]),
    ]
    lines += [f"  {name:<30}{value}" for name, value in rows]
    lines.append(f"  {'(ms)':<10}" + "".join(f"{h:>11}" for h in ("mean", *(f"p{q}" for q in PERCENTILES))))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        dist = summary[key]
        cells = [dist["mean"], *(dist[f"p{q}"] for q in PERCENTILES)]
        lines.append(f"  {name:<10}" + "".join(f"{_fmt(c):>11}" for c in cells))
    if summary["errors"]:
        lines.append(f"  first errors ({len(summary['errors'])} of {summary['failed']} failed):")
        lines += [f"    - {e}" for e in summary["errors"]]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "python": platform.python_version()}


def _load() -> float | None:
    """The 1-minute load average: a figure taken while other work ran on the machine shows it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


# ---------------------------------------------------------------------------------------------
# The run


def _client(args: argparse.Namespace) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No connection cap: --concurrency is the cap, and httpx's own pool limit would queue
    # requests inside the client where the wait would be counted as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                             timeout=httpx.Timeout(args.timeout), limits=limits)


async def first_model(client: Any) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models listed no model")
    return str(models[0]["id"])


async def _warm_up(client: Any, args: argparse.Namespace, path: str, model: str,
                   extra_body: dict[str, Any]) -> bool:
    """Sends the warm-up requests one by one; returns whether to send the length-forcing fields.
    A server that rejects those fields (400/422) gets requests without them from then on."""
    force = not args.no_force_length
    # A seed of its own kind, so no --seed ever makes timed prompts equal to these (a server with
    # a prefix cache would then answer them from the warm-up's work).
    prompts = make_prompts(args.warmup, args.input_len, f"warmup-{args.seed}")
    length = min(args.output_len, 16)
    for i, prompt in enumerate(prompts):
        body = build_body(args.endpoint, model, prompt, length, args.temperature, force, extra_body)
        result = await send_guarded(client, path, body, args.endpoint, args.input_len, args.timeout)
        if i == 0 and force and result.error.startswith(("HTTP 400", "HTTP 422")):
            body = build_body(args.endpoint, model, prompt, length, args.temperature, False, extra_body)
            retry = await send_guarded(client, path, body, args.endpoint, args.input_len, args.timeout)
            if retry.ok:
                print("note: the server rejected ignore_eos/min_tokens/stream_options; sending "
                      "plain requests, so outputs may stop before --output-len", file=sys.stderr)
                force = False
                result = retry
        if not result.ok:
            print(f"warm-up request {i + 1} failed: {result.error}", file=sys.stderr)
    return force


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    extra_body = json.loads(args.extra_body) if args.extra_body else {}
    load_before = _load()
    async with _client(args) as client:
        model = args.model or await first_model(client)
        force = await _warm_up(client, args, path, model, extra_body) if args.warmup else not args.no_force_length

        prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
        gaps = arrival_gaps(args.num_prompts, args.request_rate, args.seed)
        gate = asyncio.Semaphore(args.concurrency) if args.concurrency else None

        finished = 0
        show_progress = sys.stderr.isatty()

        async def one(prompt: str) -> RequestResult:
            nonlocal finished
            body = build_body(args.endpoint, model, prompt, args.output_len, args.temperature, force, extra_body)
            if gate is None:
                result = await send_guarded(client, path, body, args.endpoint, args.input_len, args.timeout)
            else:
                # The clock starts inside send_one, after the gate: queueing here is the
                # benchmark's own doing, not the server's latency.
                async with gate:
                    result = await send_guarded(client, path, body, args.endpoint, args.input_len, args.timeout)
            finished += 1
            if show_progress:
                print(f"\r{finished}/{len(prompts)} done", end="", file=sys.stderr, flush=True)
            return result

        print(f"sending {len(prompts)} requests to {args.base_url}{path} (model {model}, "
              f"concurrency {args.concurrency or 'unlimited'}, rate {args.request_rate:g}/s)", file=sys.stderr)
        start = time.perf_counter()
        tasks = []
        for prompt, gap in zip(prompts, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if show_progress:
            print(file=sys.stderr)

    summary = summarize(results, duration)
    params = {k: v for k, v in vars(args).items() if k not in ("api_key", "func") and not callable(v)}
    params["request_rate"] = str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate
    params["model"] = model
    params["length_fields_sent"] = force
    # The load average moves slowly; the figure after the run mostly reflects the run itself,
    # the one before shows whether something else was already busy on this machine.
    machine = {**machine_info(), "load_avg_1m_before": load_before, "load_avg_1m_after": _load()}
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
            "params": params, **summary}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help="server root, without /v1 (default %(default)s)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions or /v1/completions (default %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests to time (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no limit)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="new requests per second, Poisson arrivals; inf sends all at once (default %(default)s)")
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt length in words, ~tokens (default %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="max_tokens of each request (default %(default)s)")
    parser.add_argument("--no-force-length", action="store_true",
                        help="do not send ignore_eos/min_tokens/stream_options, only max_tokens")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature (default %(default)s: greedy)")
    parser.add_argument("--extra-body", default=None, metavar="JSON",
                        help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the prompts and arrival times (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed requests sent one by one first (default %(default)s); the first also "
                             "checks that the server accepts ignore_eos/min_tokens")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one request may take (default %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results to this JSON file")


def _check(args: argparse.Namespace) -> str | None:
    if args.num_prompts < 1:
        return "--num-prompts must be at least 1"
    if args.concurrency is not None and args.concurrency < 1:
        return "--concurrency must be at least 1"
    if args.output_len < 1 or args.input_len < 1:
        return "--input-len and --output-len must be at least 1"
    if args.request_rate <= 0:
        return "--request-rate must be positive (inf: all at once)"
    if args.extra_body:
        try:
            if not isinstance(json.loads(args.extra_body), dict):
                return "--extra-body must be a JSON object"
        except ValueError as exc:
            return f"--extra-body is not JSON: {exc}"
    return None


def run(args: argparse.Namespace) -> int:
    """0 when at least one request completed; 1 when none did or the server could not be asked."""
    problem = _check(args)
    if problem:
        print(f"fd bench serve: {problem}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(bench(args))
    except Exception as exc:  # noqa: BLE001 - only reaching the server at all can fail the run
        print(f"fd bench serve: cannot benchmark {args.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    p = report["params"]
    print(format_table(report, f"fd bench serve: {p['endpoint']} at {p['base_url']}, model {p['model']}, "
                               f"concurrency {p['concurrency'] or 'unlimited'}, rate {p['request_rate']}/s, "
                               f"~{p['input_len']} in / {p['output_len']} out tokens"))
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(folder, exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0 if report["completed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fd bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
