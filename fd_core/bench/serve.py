"""``fd bench serve``: load any OpenAI-compatible server and measure what a user would feel.

Every request streams (SSE). From the client's clock we take, per request, the time to the first
content chunk (TTFT), the gaps between content chunks (ITL), the end-to-end latency (E2EL) and
TPOT = (E2EL - TTFT) / (output tokens - 1). Prompt lengths are counted with the model's own
tokenizer; output tokens come from the server's usage chunk (``stream_options.include_usage``)
when it sends one, otherwise from tokenizing the streamed text. The flags are vLLM's
``vllm bench serve`` spellings, with fd's earlier ones kept as aliases. The same code talks to
fd's server, vLLM's and llama.cpp's.

Also runnable as ``python -m fd_core.bench.serve --help``.
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

from fd_core.bench import datasets, spec_decode
from fd_core.bench.datasets import WORDS, Sample, make_prompts  # noqa: F401 - scripts import them from here
from fd_core.bench.stats import (
    DEFAULT_PERCENTILES,
    distribution_ms,
    parse_percentiles,
    percentile,  # noqa: F401 - scripts import it from here
    percentile_key,
)
from fd_core.errors import ConfigError, FdError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8180  # fd serve's
SHOWN_ERRORS = 5
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# vLLM's --backend names for the two OpenAI endpoints.
BACKENDS = {"openai-chat": "chat", "openai": "completions", "vllm": "completions"}
# --percentile-metrics names (vLLM's) -> the summary's key, the table's name.
METRICS = {"ttft": ("ttft_ms", "TTFT"), "tpot": ("tpot_ms", "TPOT"), "itl": ("itl_ms", "ITL"),
           "e2el": ("e2e_ms", "E2EL")}
DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 64

# vLLM bench flags fd cannot honour: refused with the reason rather than ignored.
REFUSED = {
    "--goodput": "fd bench serve does not count goodput; it reports the latency distributions",
    "--profile": "it drives vLLM's /start_profile, which fd serve does not have",
    "--burstiness": "arrivals are a Poisson process only (vLLM's burstiness 1)",
    "--ramp-up-strategy": "the request rate is constant over a run",
    "--ramp-up-start-rps": "the request rate is constant over a run",
    "--ramp-up-end-rps": "the request rate is constant over a run",
    "--random-range-ratio": "random prompts all have --random-input-len tokens",
    "--random-prefix-len": "random prompts share no prefix",
    "--use-beam-search": "fd serve has no beam search",
    "--lora-modules": "fd serve has no LoRA adapters",
    "--append-result": "each run writes its own file (--save-result)",
    "--tokenizer-mode": "the tokenizer is always the model's own, loaded as fd serve loads it",
}


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    usage_seen: bool = False  # the output token count came from the server's usage chunk
    server_prompt_tokens: int | None = None  # usage.prompt_tokens (chat: with the template's tokens)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    token_times: list[float] = field(default_factory=list)  # time.perf_counter() of each chunk
    text: str = ""  # the streamed output


# ---------------------------------------------------------------------------------------------
# Workload


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each of ``n`` requests: exponential gaps (a Poisson process) at
    ``rate`` requests/s, or all zero for an infinite rate. A generator apart from the prompts' so
    that changing the rate does not change the prompts."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed + 1)
    return [rng.expovariate(rate) for _ in range(n)]


def build_body(endpoint: str, model: str, prompt: str, output_len: int, temperature: float,
               force_length: bool, extra_body: dict[str, Any], usage: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": output_len, "temperature": temperature,
                            "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if usage:  # the server's own token counts in a last chunk (OpenAI's field)
        body["stream_options"] = {"include_usage": True}
    if force_length:
        # Not OpenAI fields, but vLLM, fd and llama-cpp-python read one or the other; servers that
        # know neither ignore them and may stop early, which the output token counts then show.
        body["ignore_eos"] = True
        body["min_tokens"] = output_len
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
    that cancels the call midway still has what came before. Without a usage chunk the output
    token count is the number of content chunks (``bench`` recounts with the tokenizer)."""
    result = result or RequestResult()
    result.prompt_tokens = fallback_prompt_tokens
    chunks = 0
    pieces: list[str] = []
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
            piece = _chunk_text(endpoint, chunk)
            if piece:
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
                pieces.append(piece)
                result.token_times.append(now)
            usage = chunk.get("usage")
            if usage:
                result.usage_seen = True
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                if usage.get("prompt_tokens") is not None:
                    result.server_prompt_tokens = int(usage["prompt_tokens"])
                    result.prompt_tokens = result.server_prompt_tokens
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    result.cached_tokens = int(details["cached_tokens"])
    result.e2e = time.perf_counter() - start
    result.text = "".join(pieces)
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


@dataclass(frozen=True)
class Load:
    """What every timed request of a run is sent with: all a client process needs besides its
    share of the samples (picklable, unlike the argparse namespace)."""

    base_url: str
    endpoint: str
    model: str
    temperature: float
    force_length: bool
    usage: bool
    extra_body: dict[str, Any]
    api_key: str | None
    timeout: float

    @classmethod
    def of(cls, args: argparse.Namespace, p: Plan, model: str, force: bool, usage: bool) -> Load:
        return cls(p.base_url, p.endpoint, model, args.temperature, force, usage, p.extra_body, args.api_key,
                   args.timeout)

    def body(self, sample: Sample) -> dict[str, Any]:
        return build_body(self.endpoint, self.model, sample.prompt, sample.output_len, self.temperature,
                          self.force_length, self.extra_body, self.usage)


async def _measure(client: Any, load: Load, samples: Sequence[Sample], gaps: Sequence[float],
                   concurrency: int | None, progress: bool = False) -> list[RequestResult]:
    """Sends ``samples`` (each after its arrival gap, at most ``concurrency`` at once) and returns
    their results in the samples' order."""
    path = ENDPOINTS[load.endpoint]
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    finished = 0

    async def one(sample: Sample) -> RequestResult:
        nonlocal finished
        body = load.body(sample)
        if gate is None:
            result = await send_guarded(client, path, body, load.endpoint, sample.prompt_len, load.timeout)
        else:
            # The clock starts inside send_one, after the gate: queueing here is the
            # benchmark's own doing, not the server's latency.
            async with gate:
                result = await send_guarded(client, path, body, load.endpoint, sample.prompt_len, load.timeout)
        finished += 1
        if progress:
            print(f"\r{finished}/{len(samples)} done", end="", file=sys.stderr, flush=True)
        return result

    tasks = []
    for sample, gap in zip(samples, gaps):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(sample)))
    results = await asyncio.gather(*tasks)
    if progress:
        print(file=sys.stderr)
    return results


def _shares(total: int | None, parts: int) -> list[int | None]:
    if total is None:
        return [None] * parts
    return [total // parts + (1 if j < total % parts else 0) for j in range(parts)]


def _client_process(load: Load, samples: list[Sample], gaps: list[float], concurrency: int | None,
                    go: Any, out: Any, index: int) -> None:
    """One of ``--client-processes``: its client made, it waits for ``go`` so that every process
    starts sending together, then sends its share and puts its results on ``out``."""

    async def main() -> list[RequestResult]:
        async with _client(load.base_url, load.api_key, load.timeout) as client:
            out.put(("ready", index, None))
            await asyncio.to_thread(go.wait)
            return await _measure(client, load, samples, gaps, concurrency)

    try:
        out.put(("done", index, asyncio.run(main())))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it; a silent death would hang it
        out.put(("failed", index, f"{type(exc).__name__}: {exc}"))


def _measure_in_processes(load: Load, samples: Sequence[Sample], processes: int, rate: float,
                          concurrency: int | None, seed: int) -> tuple[list[RequestResult], float]:
    """The timed requests sent from ``processes`` client processes, the samples dealt round-robin,
    each process with its share of the concurrency and of the request rate (Poisson arrivals at
    rate/k in each of k processes add up to rate). One process parses one stream's events at a
    few tens of µs each; at tens of thousands of events a second it falls behind and the gaps it
    measures are its own (docs/PERFORMANCE.md, "Several HTTP processes, the load generator's own
    limit, and the engine's slow steps")."""
    import multiprocessing
    import queue

    ctx = multiprocessing.get_context("spawn")  # no fork of this process's running event loop
    go, out = ctx.Event(), ctx.Queue()
    shards = [list(range(j, len(samples), processes)) for j in range(processes)]
    shares = _shares(concurrency, processes)
    procs = [ctx.Process(target=_client_process, daemon=True,
                         args=(load, [samples[i] for i in shard],
                               arrival_gaps(len(shard), rate / processes, seed + 7919 * j), shares[j], go, out, j))
             for j, shard in enumerate(shards)]
    for proc in procs:
        proc.start()
    found: dict[int, list[RequestResult]] = {}
    ready = 0
    start = None
    try:
        while len(found) < processes:
            try:
                kind, index, value = out.get(timeout=1.0)
            except queue.Empty:
                dead = [j for j, proc in enumerate(procs) if not proc.is_alive() and j not in found]
                if dead:
                    raise RuntimeError(f"client process {dead[0]} exited with status "
                                       f"{procs[dead[0]].exitcode} before it reported")
                continue
            if kind == "failed":
                raise RuntimeError(f"client process {index} failed: {value}")
            if kind == "ready":
                ready += 1
                if ready == processes:
                    start = time.perf_counter()
                    go.set()
            else:
                found[index] = value
        duration = time.perf_counter() - (start or time.perf_counter())
    finally:
        go.set()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
    placed: dict[int, RequestResult] = {}
    for j, shard in enumerate(shards):
        placed.update(zip(shard, found[j]))
    return [placed[i] for i in range(len(samples))], duration


# ---------------------------------------------------------------------------------------------
# Figures


def _source(flags: list[bool]) -> str:
    if not flags:
        return "none"
    return "usage" if all(flags) else "tokenizer" if not any(flags) else "mixed"


def summarize(results: Sequence[RequestResult], duration: float,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    server_prompt = [r.server_prompt_tokens for r in done if r.server_prompt_tokens is not None]
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
        # What the server counted as prompt: with the chat template's tokens on /v1/chat/completions.
        "total_server_prompt_tokens": sum(server_prompt) if len(server_prompt) == len(done) and done else None,
        # "usage": output tokens counted by the server; "tokenizer": by tokenizing the streamed text.
        "token_counts_from": _source([r.usage_seen for r in done]),
        "percentiles": list(percentiles),
        "ttft_ms": distribution_ms([r.ttft for r in done], percentiles),
        "tpot_ms": distribution_ms([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
                                   percentiles),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl], percentiles),
        "e2e_ms": distribution_ms([r.e2e for r in done], percentiles),
        "errors": [r.error for r in failed[:SHOWN_ERRORS]],
    }


def vllm_fields(summary: dict[str, Any], metrics: Sequence[str]) -> dict[str, Any]:
    """The same figures under the names vLLM's result files use (``mean_ttft_ms``,
    ``p99_itl_ms``, ``output_throughput``...), so scripts that read those read these."""
    out: dict[str, Any] = {
        "duration": summary["duration_s"],
        "request_throughput": summary["requests_per_s"],
        "output_throughput": summary["output_tokens_per_s"],
        "total_token_throughput": summary["input_tokens_per_s"] + summary["output_tokens_per_s"],
    }
    spec = summary.get("spec_decode")
    if spec is not None:
        out |= {f"spec_decode_{key}": value for key, value in spec.items()}
    for metric in metrics:
        for stat, value in summary[METRICS[metric][0]].items():
            out[f"{stat}_{metric}_ms"] = value
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(summary: dict[str, Any], title: str, metrics: Sequence[str] = tuple(METRICS)) -> str:
    lines = [title]
    rows = [
        ("requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("requests/s", f"{summary['requests_per_s']:.2f}"),
        ("input tokens (tokenizer)", f"{summary['total_input_tokens']}"),
        ("output tokens", f"{summary['total_output_tokens']} (counted by {summary['token_counts_from']})"),
        ("input tokens/s", f"{summary['input_tokens_per_s']:.2f}"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.2f}"),
    ]
    rows += spec_decode.table_rows(summary.get("spec_decode"))
    lines += [f"  {name:<30}{value}" for name, value in rows]
    keys = ["mean", *(percentile_key(q) for q in summary["percentiles"])]
    lines.append(f"  {'(ms)':<10}" + "".join(f"{k:>11}" for k in keys))
    for metric in metrics:
        key, name = METRICS[metric]
        lines.append(f"  {name:<10}" + "".join(f"{_fmt(summary[key][k]):>11}" for k in keys))
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
# What the flags ask for


@dataclass
class Plan:
    """The flags resolved: vLLM's and fd's spellings reconciled, checked before any request."""
    base_url: str
    endpoint: str  # "chat" or "completions"
    dataset: str  # "random" or "sharegpt"
    pairs: list[tuple[str, str]]  # a ShareGPT file's exchanges
    input_len: int
    output_len: int | None  # None: a ShareGPT reply's own length
    percentiles: tuple[float, ...]
    metrics: tuple[str, ...]
    force_length: bool
    extra_body: dict[str, Any]
    save: bool


def _endpoint(args: argparse.Namespace) -> str:
    endpoint = None
    if args.endpoint is not None:
        by_path = {path: name for name, path in ENDPOINTS.items()}
        endpoint = args.endpoint if args.endpoint in ENDPOINTS else by_path.get("/" + args.endpoint.strip("/"))
        if endpoint is None:
            raise ConfigError(f"--endpoint {args.endpoint}: fd bench serve speaks chat ({ENDPOINTS['chat']}) "
                              f"or completions ({ENDPOINTS['completions']})")
    if args.backend is not None:
        if args.backend not in BACKENDS:
            raise ConfigError(f"--backend {args.backend}: fd bench serve speaks the OpenAI API: "
                              f"{', '.join(BACKENDS)}")
        if endpoint is not None and endpoint != BACKENDS[args.backend]:
            raise ConfigError(f"--backend {args.backend} sends to {ENDPOINTS[BACKENDS[args.backend]]}, "
                              f"--endpoint {args.endpoint} elsewhere; give one")
        endpoint = BACKENDS[args.backend]
    return endpoint or "chat"


def _base_url(args: argparse.Namespace) -> str:
    if args.base_url is not None:
        if args.host is not None or args.port is not None:
            raise ConfigError("give --base-url or --host/--port, not both")
        return args.base_url.rstrip("/")
    return f"http://{args.host or DEFAULT_HOST}:{args.port or DEFAULT_PORT}"


def _given(*values: int | None) -> Any:
    """The first value a flag was given (vLLM's dataset-specific lengths before the general ones)."""
    return next((v for v in values if v is not None), None)


def plan(args: argparse.Namespace) -> Plan:
    """Raises ConfigError, in one line, for anything a run could not honour."""
    if args.refused:
        flag = args.refused[0]
        raise ConfigError(f"{flag} (vLLM's) is not supported: {REFUSED[flag]}")
    if args.num_prompts < 1:
        raise ConfigError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be at least 1")
    if args.request_rate <= 0:
        raise ConfigError("--request-rate must be positive (inf: all at once)")
    if args.warmup < 0:
        raise ConfigError("--num-warmups must be 0 or more")
    if args.client_processes < 1:
        raise ConfigError("--client-processes must be at least 1")
    most = min(args.num_prompts, args.max_concurrency or args.num_prompts)
    if args.client_processes > most:
        raise ConfigError(f"--client-processes {args.client_processes} is more than the "
                          f"{'--max-concurrency' if most < args.num_prompts else '--num-prompts'} of {most}: "
                          "each process needs a request in flight")
    if args.ignore_eos and args.no_force_length:
        raise ConfigError("--ignore-eos and --no-force-length contradict each other; give one")
    try:
        percentiles = parse_percentiles(args.metric_percentiles)
    except ValueError as exc:
        raise ConfigError(f"--metric-percentiles {args.metric_percentiles}: {exc}") from None
    metrics = tuple(dict.fromkeys(m.strip() for m in args.percentile_metrics.split(",")))
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ConfigError(f"--percentile-metrics: {unknown[0]!r} is none of {', '.join(METRICS)}")
    extra_body: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except ValueError as exc:
            raise ConfigError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra_body, dict):
            raise ConfigError("--extra-body must be a JSON object")
    if isinstance(args.save_result, str) and args.result_filename:
        raise ConfigError(f"the result file is given twice: --save-result {args.save_result} and "
                          f"--result-filename {args.result_filename}; give it once")

    for flag in ("random_input_len", "input_len", "random_output_len", "output_len", "sharegpt_output_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1")
    base_url, endpoint = _base_url(args), _endpoint(args)
    if args.plot:
        from fd_core.bench.plot import require_matplotlib

        require_matplotlib()  # before the run, not after it
    dataset = args.dataset_name or ("sharegpt" if args.dataset_path else "random")
    pairs: list[tuple[str, str]] = []
    if dataset == "sharegpt":
        if not args.dataset_path:
            raise ConfigError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-style JSON file)")
        pairs = datasets.read_sharegpt(args.dataset_path)
        output_len = _given(args.sharegpt_output_len, args.output_len)
    elif dataset == "random":
        if args.dataset_path:
            raise ConfigError("--dataset-path is read with --dataset-name sharegpt; random prompts need no file")
        output_len = _given(args.random_output_len, args.output_len, DEFAULT_OUTPUT_LEN)
    else:
        raise ConfigError(f"--dataset-name {dataset}: fd bench serve has random and sharegpt "
                          "(a ShareGPT-style JSON file)")
    input_len = _given(args.random_input_len, args.input_len, DEFAULT_INPUT_LEN)
    return Plan(base_url=base_url, endpoint=endpoint, dataset=dataset, pairs=pairs,
                input_len=input_len, output_len=output_len, percentiles=percentiles, metrics=metrics,
                force_length=not args.no_force_length, extra_body=extra_body,
                save=bool(args.save_result or args.result_filename or args.result_dir))


def result_path(args: argparse.Namespace, model: str, rate: float, when: datetime) -> str:
    """Where --save-result writes: its PATH, else --result-filename, else vLLM's pattern
    ``{label}-{rate}qps[-concurrency{N}]-{model}-{time}.json``; under --result-dir if given."""
    name = args.save_result if isinstance(args.save_result, str) else args.result_filename
    if not name:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = f"{args.backend or 'fd'}-{rate}qps{concurrency}-{model.rstrip('/').split('/')[-1]}-" \
               f"{when.strftime('%Y%m%d-%H%M%S')}.json"
    return os.path.join(args.result_dir, name) if args.result_dir else name


# ---------------------------------------------------------------------------------------------
# The run


def _client(base_url: str, api_key: str | None, timeout: float) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No connection cap: --max-concurrency is the cap, and httpx's own pool limit would queue
    # requests inside the client where the wait would be counted as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base_url, headers=headers, timeout=httpx.Timeout(timeout), limits=limits)


async def first_model_card(client: Any) -> dict[str, Any]:
    """The first entry of GET /v1/models: its ``id`` is the name to send, its ``root`` (fd's and
    vLLM's servers give one) the model it was loaded from."""
    response = await client.get("/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError("GET /v1/models listed no model")
    return dict(models[0])


async def _tokenizer(client: Any, args: argparse.Namespace, card: dict[str, Any] | None) -> tuple[Any, str]:
    """--tokenizer, else vLLM's default (--model), else the model the server says it loaded."""
    if args.tokenizer:
        tokenizer, _, _ = datasets.find_tokenizer([("--tokenizer", args.tokenizer)])
        return tokenizer, f"--tokenizer {args.tokenizer}"
    candidates = [("--model", args.model)] if args.model else []
    if card is None:
        try:
            card = await first_model_card(client)
        except Exception:  # noqa: BLE001 - only a way to find the tokenizer; --model may do
            card = {}
    for key, origin in (("root", "the server's model"), ("id", "the server's model name")):
        if card.get(key) and card[key] not in [name for _, name in candidates]:
            candidates.append((origin, str(card[key])))
    tokenizer, origin, name = datasets.find_tokenizer(candidates)
    return tokenizer, f"{origin} {name}"


def _samples(args: argparse.Namespace, p: Plan, tokenizer: Any) -> tuple[list[Sample], str]:
    """The timed requests' prompts and lengths, and a line that says what they are."""
    if p.dataset == "random":
        samples = datasets.random_samples(args.num_prompts, p.input_len, p.output_len or DEFAULT_OUTPUT_LEN,
                                          args.seed, tokenizer)
        return samples, f"random prompts of {p.input_len} tokens, {samples[0].output_len} out"
    found, seen = datasets.sharegpt_samples(p.pairs, args.num_prompts, args.seed, tokenizer, p.output_len,
                                            args.dataset_path)
    line = (f"sharegpt {args.dataset_path}: {len(found)} of {len(p.pairs)} exchanges taken ({seen - len(found)} "
            f"looked at were outside the length limits)")
    if len(found) < args.num_prompts:
        # vLLM oversamples too; repeats may be answered faster by a server with a prefix cache.
        line += f"; repeated to make {args.num_prompts} prompts"
    samples = [found[i % len(found)] for i in range(args.num_prompts)]
    return samples, line


async def _warm_up(client: Any, args: argparse.Namespace, p: Plan, model: str, tokenizer: Any,
                   input_len: int) -> tuple[bool, bool]:
    """Sends the warm-up requests one by one; returns whether to send the length-forcing fields
    and stream_options. A server that rejects them (400/422) gets plain requests from then on."""
    path = ENDPOINTS[p.endpoint]
    force, usage = p.force_length, True
    # A seed of its own kind, so no --seed ever makes timed prompts equal to these (a server with
    # a prefix cache would then answer them from the warm-up's work).
    warm = datasets.random_samples(args.warmup, input_len, min(p.output_len or 16, 16), f"warmup-{args.seed}",
                                   tokenizer)
    print(f"warming up: {len(warm)} untimed request(s), one at a time", file=sys.stderr, flush=True)
    for i, sample in enumerate(warm):
        body = build_body(p.endpoint, model, sample.prompt, sample.output_len, args.temperature, force, p.extra_body,
                          usage)
        result = await send_guarded(client, path, body, p.endpoint, sample.prompt_len, args.timeout)
        if i == 0 and result.error.startswith(("HTTP 400", "HTTP 422")):
            body = build_body(p.endpoint, model, sample.prompt, sample.output_len, args.temperature, False,
                              p.extra_body, usage=False)
            retry = await send_guarded(client, path, body, p.endpoint, sample.prompt_len, args.timeout)
            if retry.ok:
                print("note: the server rejected ignore_eos/min_tokens/stream_options; sending plain requests, "
                      "so outputs may stop before their length and are counted with the tokenizer",
                      file=sys.stderr)
                force = usage = False
                result = retry
        if not result.ok:
            print(f"warm-up request {i + 1} failed: {result.error}", file=sys.stderr)
    return force, usage


async def bench(args: argparse.Namespace, p: Plan | None = None) -> dict[str, Any]:
    p = p or plan(args)
    path = ENDPOINTS[p.endpoint]
    load_before = _load()
    async with _client(p.base_url, args.api_key, args.timeout) as client:
        card = None
        if not (args.served_model_name or args.model):
            card = await first_model_card(client)
        model = args.served_model_name or args.model or str(card["id"])
        tokenizer, tokenizer_from = await _tokenizer(client, args, card)
        samples, workload = _samples(args, p, tokenizer)
        print(f"tokenizer: {tokenizer_from}\ndataset: {workload}", file=sys.stderr)
        force, usage = p.force_length, True
        if args.warmup:
            force, usage = await _warm_up(client, args, p, model, tokenizer, samples[0].prompt_len)

        spec_before = await spec_decode.scrape(client)
        print(f"measuring: {len(samples)} requests to {p.base_url}{path} (model {model}, max concurrency "
              f"{args.max_concurrency or 'unlimited'}, rate {args.request_rate:g}/s"
              + (f", {args.client_processes} client processes" if args.client_processes > 1 else "") + ")",
              file=sys.stderr, flush=True)
        if args.client_processes > 1:
            results, duration = await asyncio.to_thread(
                _measure_in_processes, Load.of(args, p, model, force, usage), samples, args.client_processes,
                args.request_rate, args.max_concurrency, args.seed)
        else:
            progress = sys.stderr.isatty() and not args.disable_tqdm
            start = time.perf_counter()
            results = await _measure(client, Load.of(args, p, model, force, usage), samples,
                                     arrival_gaps(len(samples), args.request_rate, args.seed), args.max_concurrency,
                                     progress)
            duration = time.perf_counter() - start
        spec = spec_decode.difference(spec_before, await spec_decode.scrape(client))

    for sample, result in zip(samples, results):
        # The prompt as the tokenizer counts it (vLLM's input length); the server's own count,
        # with a chat template's tokens, stays in server_prompt_tokens.
        result.prompt_tokens = sample.prompt_len
        if result.ok and not result.usage_seen:
            result.output_tokens = datasets.count_tokens(tokenizer, result.text)
    summary = summarize(results, duration, p.percentiles)
    summary["spec_decode"] = spec
    params = {k: v for k, v in vars(args).items() if k not in ("api_key", "func", "refused") and not callable(v)}
    params.update(request_rate=str(args.request_rate) if math.isinf(args.request_rate) else args.request_rate,
                  model=model, base_url=p.base_url, endpoint=p.endpoint, dataset_name=p.dataset,
                  tokenizer=tokenizer_from, length_fields_sent=force, percentile_metrics=list(p.metrics),
                  # fd's earlier names, read by benchmarks/compare_llama_cpp.py and older result readers
                  concurrency=args.max_concurrency, input_len=p.input_len if p.dataset == "random" else None,
                  output_len=p.output_len)
    # The load average moves slowly; the figure after the run mostly reflects the run itself,
    # the one before shows whether something else was already busy on this machine.
    machine = {**machine_info(), "load_avg_1m_before": load_before, "load_avg_1m_after": _load()}
    per_request = {
        "input_lens": [s.prompt_len for s in samples],
        "output_lens": [r.output_tokens if r.ok else 0 for r in results],
        "ttfts": [r.ttft if r.ok else None for r in results],  # seconds, as vLLM saves them
        "itls": [r.itl if r.ok else [] for r in results],
        "latencies": [r.e2e if r.ok else None for r in results],
    }
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine,
            "params": params, "workload": workload, **summary, **vllm_fields(summary, p.metrics), **per_request}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``bench serve`` flags where fd honours them (fd's earlier spellings as aliases)."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default=None,
                        help=f"server root, without /v1 (default: http://--host:--port, "
                             f"http://{DEFAULT_HOST}:{DEFAULT_PORT})")
    server.add_argument("--host", default=None, help=f"server host, when no --base-url (default {DEFAULT_HOST})")
    server.add_argument("--port", type=int, default=None,
                        help=f"server port, when no --base-url (default {DEFAULT_PORT}, fd serve's; vLLM's is 8000)")
    server.add_argument("--endpoint", default=None,
                        help="chat or completions, or their paths /v1/chat/completions, /v1/completions "
                             "(default: chat, or what --backend says)")
    server.add_argument("--backend", default=None,
                        help="vLLM's name for the endpoint: openai-chat (chat), openai or vllm (completions) "
                             "(default: none; --endpoint decides)")
    server.add_argument("--model", default=None,
                        help="model name to send, and the tokenizer's source as in vLLM (default: the first "
                             "of GET /v1/models)")
    server.add_argument("--served-model-name", default=None,
                        help="model name to send when it differs from --model (default: --model)")
    server.add_argument("--tokenizer", default=None,
                        help="model folder, .gguf file or known name whose tokenizer counts tokens (default: "
                             "--model, else the model the server reports in GET /v1/models)")
    server.add_argument("--trust-remote-code", action="store_true",
                        help="accepted for vLLM's scripts; fd runs no code from a model (default: off)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="bearer token (default: $OPENAI_API_KEY)")

    load = parser.add_argument_group("workload")
    load.add_argument("--dataset-name", default=None,
                      help="random (synthetic prompts) or sharegpt (--dataset-path) (default: sharegpt with "
                           "--dataset-path, else random)")
    load.add_argument("--dataset-path", default=None, metavar="FILE",
                      help='ShareGPT-style JSON: a list of {"conversations": [{"from": "human", "value": ...}, '
                           '{"from": "gpt", "value": ...}]}; the first human turn is the prompt, the reply\'s '
                           f"token count max_tokens. Kept as vLLM keeps them: prompt {datasets.MIN_LEN}.."
                           f"{datasets.MAX_PROMPT_LEN} tokens, reply at least {datasets.MIN_LEN}, both at most "
                           f"{datasets.MAX_TOTAL_LEN}; shuffled by --seed; repeated when fewer than "
                           "--num-prompts (default: none)")
    load.add_argument("--num-prompts", type=int, default=64, help="requests to time (default %(default)s)")
    load.add_argument("--random-input-len", type=int, default=None,
                      help=f"random prompts' length in the model's tokens (default {DEFAULT_INPUT_LEN}; "
                           "vLLM's is 1024)")
    load.add_argument("--input-len", type=int, default=None, help="same as --random-input-len (default: none)")
    load.add_argument("--random-output-len", type=int, default=None,
                      help=f"max_tokens of random prompts (default {DEFAULT_OUTPUT_LEN}; vLLM's is 128)")
    load.add_argument("--output-len", type=int, default=None,
                      help="max_tokens of every request, whatever the dataset, unless a --random-output-len "
                           "or --sharegpt-output-len is given (default: none)")
    load.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="max_tokens of ShareGPT prompts instead of each reply's length (default: none)")
    load.add_argument("--max-concurrency", "--concurrency", dest="max_concurrency", type=int, default=None, metavar="N",
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="new requests per second, Poisson arrivals; inf sends all at once (default %(default)s)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos (and min_tokens) so outputs run to max_tokens: fd's default "
                           "already, unlike vLLM's (default: on unless --no-force-length)")
    load.add_argument("--no-force-length", action="store_true",
                      help="send no ignore_eos/min_tokens, only max_tokens: outputs may stop early (default: off)")
    load.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature (default %(default)s: greedy)")
    load.add_argument("--extra-body", default=None, metavar="JSON",
                      help="JSON object merged into every request body, e.g. '{\"top_k\": 1}' (default: none)")
    load.add_argument("--seed", type=int, default=0,
                      help="seed of the prompts, the ShareGPT shuffle and arrival times (default %(default)s)")
    load.add_argument("--num-warmups", "--warmup", dest="warmup", type=int, default=1, metavar="N",
                      help="untimed requests sent one by one first (default %(default)s); the first also "
                           "checks that the server accepts ignore_eos/min_tokens")
    load.add_argument("--timeout", type=float, default=600.0,
                      help="seconds one request may take (default %(default)s)")
    load.add_argument("--client-processes", type=int, default=1, metavar="N",
                      help="send from N processes, each with its share of the prompts, the concurrency and "
                           "the rate: one process parses a few tens of thousands of streamed chunks a second "
                           "at most, beyond which the ITL it measures is its own lag (default %(default)s)")
    load.add_argument("--disable-tqdm", action="store_true",
                      help="no progress line on a terminal (default: shown on a terminal)")

    out = parser.add_argument_group("results")
    out.add_argument("--percentile-metrics", default=",".join(METRICS), metavar="LIST",
                     help="metrics whose percentiles the table and vLLM-named result fields show, of "
                          f"{','.join(METRICS)} (default %(default)s; vLLM's is ttft,tpot,itl)")
    out.add_argument("--metric-percentiles", default=",".join(f"{q:g}" for q in DEFAULT_PERCENTILES), metavar="LIST",
                     help="percentiles to report, e.g. 50,90,99.9 (default %(default)s; vLLM's is 99)")
    out.add_argument("--save-result", nargs="?", const=True, default=None, metavar="PATH",
                     help="write the results as JSON: to PATH, else to --result-filename, else to vLLM's "
                          "{label}-{rate}qps-concurrency{N}-{model}-{time}.json (default: not written)")
    out.add_argument("--json", dest="save_result", metavar="PATH", help="same as --save-result PATH")
    out.add_argument("--result-dir", default=None, metavar="DIR",
                     help="folder for the result file; implies --save-result (default: the current one)")
    out.add_argument("--result-filename", default=None, metavar="NAME",
                     help="result file name; implies --save-result (default: vLLM's pattern)")
    out.add_argument("--plot", default=None, metavar="PNG",
                     help="also draw TTFT and ITL histograms with the chosen percentiles to this PNG "
                          "(needs matplotlib: pip install 'fd-core[bench]') (default: none)")

    refused = parser.add_argument_group(
        "refused", "vLLM's flags that fd cannot honour are refused with the reason: " + ", ".join(REFUSED))
    for flag in REFUSED:
        refused.add_argument(flag, nargs="*", action=_Refused, dest="refused", default=[],
                             help=argparse.SUPPRESS)


class _Refused(argparse.Action):
    """Records the flag so that the run refuses it with its reason, in one line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.refused = [*getattr(namespace, "refused", []), option_string]


def _write(path: str, write: Any) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    write(path)


def run(args: argparse.Namespace) -> int:
    """0 when at least one request completed; 1 when none did or the server could not be asked;
    2 for flags, files or a tokenizer that cannot be used."""
    try:
        p = plan(args)
    except FdError as exc:
        print(f"fd bench serve: {exc}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(bench(args, p))
    except FdError as exc:  # the tokenizer or the dataset's lengths
        print(f"fd bench serve: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - only reaching the server at all can fail the run
        print(f"fd bench serve: cannot benchmark {p.base_url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    params = report["params"]
    title = (f"fd bench serve: {params['endpoint']} at {params['base_url']}, model {params['model']}, "
             f"max concurrency {params['max_concurrency'] or 'unlimited'}, rate {params['request_rate']}/s, "
             f"{report['workload']}")
    print(format_table(report, title, p.metrics))
    try:
        if p.save:
            path = result_path(args, params["model"], args.request_rate, datetime.now())

            def dump(target: str) -> None:
                with open(target, "w", encoding="utf-8") as f:
                    json.dump(report, f, indent=2)
                    f.write("\n")

            _write(path, dump)
            print(f"results: {path}", file=sys.stderr)
        if args.plot:
            from fd_core.bench.plot import save_plot

            concurrency = f"max concurrency {params['max_concurrency'] or 'unlimited'}"
            plot_title = (f"{params['model']} · {params['endpoint']} · {concurrency} · {p.dataset} · "
                          f"{report['completed']} requests")
            ttft = [t * 1000 for t in report["ttfts"] if t is not None]
            itl = [g * 1000 for gaps in report["itls"] for g in gaps]
            _write(args.plot, lambda target: save_plot(target, ttft, itl, p.percentiles, plot_title))
            print(f"plot: {args.plot}", file=sys.stderr)
    except OSError as exc:
        print(f"fd bench serve: cannot write {exc.filename or 'the results'}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0 if report["completed"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fd bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
