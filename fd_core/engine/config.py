"""EngineConfig: every knob of one engine instance, validated before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from fd_core.engine.sampling_params import MAX_LOGPROBS
from fd_core.engine.speculative.config import SpeculativeConfig
from fd_core.errors import ConfigError
from fd_core.interfaces import Capabilities
from fd_core.quantization.kv_cache import KV_QUANTIZED
from fd_core.quantization.quantize import check_group_size, method_name

# auto: the checkpoint's weights; dummy: random ones from its config (loader/dummy.py)
LOAD_FORMATS = ("auto", "dummy")

GiB = 1 << 30
# --kv-cache-dtype: "auto" keeps the cache in the model's dtype; the quantized ones are served
# where a backend declares them in Capabilities.kv_cache_dtypes
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", *KV_QUANTIZED)
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's spelling
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # where the platform proposes no budget of its own
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_KV_CACHE_MEMORY_GB = 2.0  # where the backend does not profile device memory


@dataclass
class EngineConfig:
    """Names follow FastDeploy's / vLLM's flags.

    KV-cache size: ``num_kv_blocks`` if given, else ``kv_cache_memory_gb`` GiB if given (capped
    at half the free memory), else on a backend with ``memory_profiling``
    ``gpu_memory_utilization`` (default 0.9) of the device memory minus what the model occupies
    after a profiling pass, else 2 GiB (capped likewise) — the CPU backend's way. Asking for
    both ``kv_cache_memory_gb`` and ``gpu_memory_utilization`` is an error.

    Left as None, ``enable_prefix_caching`` and ``enable_chunked_prefill`` are on where the
    backend supports them, ``max_num_batched_tokens`` is the platform's proposal (its
    ``default_max_num_batched_tokens``, else 2048) — or, with chunked prefill off, large enough
    for a ``max_model_len`` prompt — and ``long_prefill_token_threshold`` is the platform's
    ``default_long_prefill_token_threshold``, else 0 (no cap). ``check_against`` and
    ``resolve_budget`` fill them in; asked for explicitly, a feature the backend lacks stops
    start-up.

    ``long_prefill_token_threshold``: the most prompt tokens one sequence computes in a step
    while others run or wait; budget the others leave goes back to it (the scheduler's policy,
    ``fd_core/engine/scheduler.py``). 0: no cap. It needs chunked prefill.
    """

    model: str
    device: str = "auto"
    runtime: str | None = None  # the tensor library to run on (--runtime); None: the platform's default
    dtype: str = "auto"  # auto: the platform's default_dtype, else its fastest (auto_dtype)
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None  # default: the platform's, else 0 (no cap)
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float | None = None  # default: DEFAULT_KV_CACHE_MEMORY_GB or profiled
    gpu_memory_utilization: float | None = None  # default 0.9 where the backend profiles memory
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    swap_space: float = 0.0  # GiB of host memory for preemption by swap; 0: recompute instead
    seed: int = 0
    op_pins: dict[str, str] = field(default_factory=dict)
    tensor_parallel_size: int = 1
    # a mixture of experts' experts dealt out whole over the tensor-parallel ranks
    enable_expert_parallel: bool = False
    # auto: the checkpoint's weights; dummy: random ones from its config (speed and memory runs)
    load_format: str = "auto"
    quantization: str | None = None  # wint8, wint4, block_wise_fp8 (fp8): decoder linears quantized at load
    quantization_group_size: int | None = None  # None: the method's default (wint4: 128)
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; int8 / fp8_e4m3 (fp8) where declared
    enforce_eager: bool = False  # no captured graphs, even where the backend has them
    # queue step t+1 before reading step t's tokens; None: where the backend has sample_async, one rank
    async_scheduling: bool | None = None
    # device steps per host round when a step is decodes only (vLLM's --num-scheduler-steps;
    # fd_core/engine/rounds.py): the host schedules and reads tokens once a round
    num_scheduler_steps: int = 1
    tokenizer: str | None = None  # another folder or .gguf to take the tokenizer from (--tokenizer)
    chat_template: str | None = None  # a template file, or the template itself (--chat-template)
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs a request may ask for (--max-logprobs)
    # no tokenizer: prompts are token ids and outputs carry token ids only (vLLM's flag)
    skip_tokenizer_init: bool = False
    # speculative decoding (--speculative-config): its JSON text, a dict of the same keys, or the
    # parsed SpeculativeConfig that validate() makes of either; None: off
    speculative_config: SpeculativeConfig | dict | str | None = None

    @property
    def cache_dtype(self) -> str:
        """What the KV cache is kept in: ``kv_cache_dtype``, or the model's dtype for auto."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    def validate(self) -> None:
        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "num_kv_blocks", "tensor_parallel_size", "num_scheduler_steps"):
            positive(name)
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0 (0: no cap), got {threshold!r}")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb is not None and not 0 < self.kv_cache_memory_gb:
            raise ConfigError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_cache_memory_gb is not None and self.gpu_memory_utilization is not None:
            raise ConfigError("--kv-cache-memory-gb and --gpu-memory-utilization both size the KV cache; give one")
        if not (isinstance(self.swap_space, (int, float)) and self.swap_space >= 0):
            raise ConfigError(f"swap_space must be a number of GiB >= 0, got {self.swap_space!r}")
        if self.runtime is not None and (not isinstance(self.runtime, str) or not self.runtime):
            raise ConfigError(f"runtime must be a runtime name such as 'paddle' or 'torch', got {self.runtime!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"--load-format {self.load_format}: accepted values are {', '.join(LOAD_FORMATS)}")
        if self.quantization is not None:
            try:
                self.quantization = method_name(self.quantization)
                self.quantization_group_size = check_group_size(self.quantization, self.quantization_group_size)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        elif self.quantization_group_size is not None:
            raise ConfigError("--quantization-group-size sets the groups of --quantization wint8/wint4; "
                              "give --quantization too")
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            accepted = ", ".join([*KV_CACHE_DTYPES, *(f"{a} (= {d})" for a, d in KV_CACHE_ALIASES.items())])
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: accepted values are {accepted}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.skip_tokenizer_init and (self.tokenizer is not None or self.chat_template is not None):
            flag = "--tokenizer" if self.tokenizer is not None else "--chat-template"
            raise ConfigError(f"{flag} has no tokenizer to act on with skip_tokenizer_init")
        if self.chat_template is not None:
            from fd_core.loader.chat_template import (
                read_chat_template,  # the loader is heavy for `fd backends`
            )

            try:
                self.chat_template = read_chat_template(self.chat_template)
            except ValueError as e:
                raise ConfigError(f"--chat-template: {e}") from None
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.speculative_config is not None and self.async_scheduling:
            raise ConfigError("--async-scheduling: speculative decoding (--speculative-config) needs each step's "
                              "accepted tokens before it schedules the next; leave asynchronous scheduling off")
        if self.num_scheduler_steps > 1 and self.speculative_config is not None:
            raise ConfigError("--num-scheduler-steps: speculative decoding (--speculative-config) verifies each "
                              "step's drafts before the next; leave it at 1")
        if self.num_scheduler_steps > 1 and self.async_scheduling is False:
            raise ConfigError("--num-scheduler-steps: a round's steps take their input tokens from the step "
                              "before on the device, which needs asynchronous scheduling; drop --no-async-scheduling")

    def check_against(self, backend: str, caps: Capabilities,
                      other_runtimes: dict[str, Capabilities] | None = None,
                      default_dtype: str | None = None) -> None:
        """Check the config against the backend's manifest — failing with one sentence naming
        the flag and the backend, before anything loads — and fill in the feature defaults
        that depend on it. ``other_runtimes``: the manifests of the backend's other runtimes
        (``--runtime``), named where one of them would serve what this one cannot;
        ``default_dtype``: the platform's choice for ``--dtype auto``."""
        if self.dtype == "auto":
            self.dtype = auto_dtype(caps, default_dtype)
        if self.dtype not in caps.dtypes:
            raise ConfigError(f"--dtype {self.dtype}: the {backend} backend supports {sorted(caps.dtypes)}")
        if self.dtype not in caps.kv_cache_dtypes:  # the KV cache is kept in the model's dtype
            raise ConfigError(f"--dtype {self.dtype}: the {backend} backend keeps its KV cache in "
                              f"{sorted(caps.kv_cache_dtypes)} only")
        kv = self.kv_cache_dtype
        if kv in ("float32", "float16", "bfloat16") and kv != self.dtype:
            raise ConfigError(f"--kv-cache-dtype {kv}: a float KV cache is kept in the model's dtype "
                              f"(--dtype {self.dtype})")
        if kv not in ("auto", self.dtype) and kv not in caps.kv_cache_dtypes:
            raise ConfigError(f"--kv-cache-dtype {kv}: the {backend} backend keeps its KV cache in "
                              f"{', '.join(sorted(caps.kv_cache_dtypes))} only")
        if self.tensor_parallel_size > caps.device_count:
            raise ConfigError(
                f"--tensor-parallel-size {self.tensor_parallel_size}: the {backend} backend sees "
                f"{caps.device_count} device(s)"
            )
        if self.tensor_parallel_size > 1 and caps.collective_library == "none":
            raise ConfigError(
                f"--tensor-parallel-size {self.tensor_parallel_size}: the {backend} backend has no "
                f"collective library"
            )
        if self.quantization is not None and self.quantization not in caps.quantization:
            have = ", ".join(sorted(caps.quantization)) or "no quantization method"
            serve = [name for name, c in (other_runtimes or {}).items() if self.quantization in c.quantization]
            hint = f" (with --runtime {serve[0]} it serves {self.quantization})" if serve else ""
            raise ConfigError(f"--quantization {self.quantization}: the {backend} backend declares {have}{hint}")
        if self.gpu_memory_utilization is not None and not caps.memory_profiling:
            raise ConfigError(
                f"--gpu-memory-utilization: the {backend} backend does not size the KV cache from "
                f"free device memory; use --kv-cache-memory-gb"
            )
        if self.enable_chunked_prefill and not caps.chunked_prefill:
            raise ConfigError(
                f"--enable-chunked-prefill: the {backend} backend does not support chunked prefill"
            )
        if self.enable_prefix_caching and not caps.prefix_caching:
            raise ConfigError(
                f"--enable-prefix-caching: the {backend} backend does not support prefix caching"
            )
        if self.swap_space and not caps.kv_swap:
            raise ConfigError(
                f"--swap-space: the {backend} backend cannot move KV-cache blocks to host memory"
            )
        if self.enable_chunked_prefill is None:
            self.enable_chunked_prefill = caps.chunked_prefill
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            why = ("chunked prefill is off" if caps.chunked_prefill
                   else f"the {backend} backend does not support chunked prefill")
            raise ConfigError(f"--long-prefill-token-threshold caps a prompt's chunks, but {why}")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = caps.prefix_caching
        if self.speculative_config is not None:
            self.speculative_config.check_against(backend, caps.speculative_methods)

    def resolve_budget(self, max_model_len: int, platform_default: int | None = None,
                       platform_threshold: int | None = None) -> None:
        """Fill in the step's token budget once the model's length is known, and the cap on one
        sequence's prefill tokens per step (none without chunked prefill)."""
        if self.max_num_batched_tokens is None:
            budget = platform_default or DEFAULT_MAX_NUM_BATCHED_TOKENS
            self.max_num_batched_tokens = budget if self.enable_chunked_prefill else max(budget, max_model_len)
        if self.long_prefill_token_threshold is None:
            self.long_prefill_token_threshold = (platform_threshold or 0) if self.enable_chunked_prefill else 0


# --dtype auto where the platform names no default_dtype: the narrowest float it computes and
# keeps a KV cache in, as vLLM's auto serves a GPU in 16 bits
AUTO_DTYPE_ORDER = ("bfloat16", "float16", "float32")


def auto_dtype(caps: Capabilities, default_dtype: str | None = None) -> str:
    """What ``--dtype auto`` means on a backend with manifest ``caps``."""
    usable = caps.dtypes & caps.kv_cache_dtypes
    if default_dtype in usable:
        return default_dtype
    for dtype in AUTO_DTYPE_ORDER:
        if dtype in usable:
            return dtype
    return min(caps.dtypes) if caps.dtypes else "float32"
