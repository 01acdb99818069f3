"""EngineCore: scheduler + model runner over token ids. No text: tokenization, detokenization
and stop strings belong to the front end (``output_processor``), so that in ``fd serve`` the
HTTP process does that work and the core process only computes.

Runtime-free: it reaches the chip only through the Platform (Memory, op table) and the shared
ModelRunner.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from fd_core.engine.bad_words import needs_history, tokenize_bad_words
from fd_core.engine.block_pool import BlockPool
from fd_core.engine.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_MEMORY_GB,
    EngineConfig,
    GiB,
)
from fd_core.engine.executor import Executor, Workers, rendezvous_address
from fd_core.engine.loading import (
    describe,
    load_runner,
    open_checkpoint,
    open_proposer,
    proposer_cache_shape,
)
from fd_core.engine.model_runner import PLACEHOLDER, Launched, Scored, StepResult
from fd_core.engine.prompts import token_id_list
from fd_core.engine.rounds import round_steps
from fd_core.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from fd_core.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from fd_core.engine.sequence import Sequence, Status
from fd_core.engine.speculative.model import ModelProposer
from fd_core.engine.speculative.proposer import NgramProposer, Proposer, pad_drafts
from fd_core.engine.speculative.verify import accepted
from fd_core.engine.structured.matchers import GrammarMatchers
from fd_core.engine.structured.worker import Advance, MaskWorker
from fd_core.engine.swap import SwapSpace
from fd_core.errors import (
    ConfigError,
    InvalidRequestError,
    PromptTooLongError,
    check_text,
)
from fd_core.heap import thaw_heap
from fd_core.interfaces import Platform, SampleOutput
from fd_core.interfaces.ops import pack_token_bitmask
from fd_core.models import TensorParallel, moe_spec
from fd_core.phases import log as startup
from fd_core.phases import phase
from fd_core.quantization.kv_cache import row_bytes as kv_row_bytes

log = logging.getLogger("fd.engine")

_SEED_MIX = 0x9E3779B97F4A7C15  # odd constant so seed+index streams do not collide


@dataclass
class PromptLogprobs:
    """A request's prompt tokens after the first, each scored given the tokens before it
    (prompt_logprobs): its raw logprob and rank, and the best ``k`` of its position."""

    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]]


_NONE = ()  # a CoreOutput's per-token lists where nothing reads them


def _columns(o: SampleOutput) -> tuple[list, list, list, list, list]:
    """A step's sample as Python lists: token ids, logprobs, ranks, top ids, top logprobs."""
    tops = (o.top_ids.tolist(), o.top_logprobs.tolist()) if o.top_ids.size else ((), ())
    return o.token_ids.tolist(), o.logprobs.tolist(), o.ranks.tolist(), *tops


@dataclass
class CoreOutput:
    """What one step, or a round of steps (``--num-scheduler-steps``), produced for one
    sequence: its new tokens in order (and their log-probabilities), and whether the core ended
    the sequence after the last (EOS, a stop token id, max_tokens, max_model_len). A request's
    first sequence brings the prompt's logprobs with its first token, when asked. One object a
    sequence and round, not a token: at 128 sequences the per-token objects were a third of
    the host's work a step (docs/PERFORMANCE.md)."""

    request_id: str
    index: int
    token_ids: list[int]
    logprob: float  # the new tokens' logprobs summed (what the cumulative logprob gains)
    # Per token where logprobs were asked for (logprobs, ranks: logprobs=0 too; top: its best
    # k), else empty; logprobs also where a stop string may end the text among the tokens. Only
    # where needed: each list a row is an object the collector's young generation counts, which
    # cost a step at 128 sequences ~30 us on the development machine (docs/PERFORMANCE.md)
    logprobs: list[float] | tuple = ()
    ranks: list[int] | tuple = ()
    top: list[list[tuple[int, float]]] | tuple = ()
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (the same every step)
    # on a sequence's first token: seconds it waited before it was first scheduled, and from then
    # to this token (the core's clock; the front end's latency metrics cannot see these events)
    time_in_queue: float | None = None
    prefill_time: float | None = None
    prompt_logprobs: PromptLogprobs | None = None


# Constrained rows from which a step's masks go to the grammar thread (deferred_bitmask): for
# fewer, handing the step over between threads costs more than its masks (H100 host, SmolLM2
# and a 1.2B Llama: at 1 row +8-35% a token deferred against +6-21% on the engine's thread; at 32
# rows +17-20% against +38-53% for SmolLM2; docs/PERFORMANCE.md, "Structured output")
DEFER_ROWS = 8


@dataclass
class _InFlight:
    """A step queued on the device whose tokens are not read yet. ``slots[row]``: where that
    row's placeholder sits in its sequence's output; ``read_first``: the next schedule needs
    its tokens on the host."""

    launched: Launched
    slots: list[int]
    read_first: bool
    advance: Advance | None = None  # its rows' grammars, advanced on the grammar thread
    # a round's later steps (engine/rounds.py), each with its slots, read after the first
    later: list[tuple[Launched, list[int]]] = field(default_factory=list)

    @property
    def last(self) -> Launched:
        """The step the next one takes its input tokens from."""
        return self.later[-1][0] if self.later else self.launched


@dataclass
class Prefilled:
    """A request whose prompt another instance computed (prefill/decode disaggregation): the
    token it sampled first, the seed its sequence drew with, the prompt tokens its prefix cache
    supplied there, and the prompt's keys and values, per rank (``EngineCore.export_kv``)."""

    first_token: int
    seed: int
    kv: list
    num_cached_tokens: int = 0


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int,
                 max_num_batched_tokens: int, chunked_prefill: bool) -> None:
    """Reject a prompt the engine could never run, with the reason. Used by every front end
    before a request is queued, and by the core itself."""
    if not token_ids:
        raise InvalidRequestError("the prompt is empty")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}"
        )
    if not chunked_prefill and len(token_ids) > max_num_batched_tokens:
        raise PromptTooLongError(
            f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
            f"{max_num_batched_tokens}, and chunked prefill is off"
        )


def check_params(params: SamplingParams, vocab_size: int, max_logprobs: int = MAX_LOGPROBS,
                 unavailable: dict[str, str] | None = None) -> None:
    """Reject sampling parameters that name tokens the model does not have, ask for more
    logprobs than the engine allows, or use a field this engine cannot honour (``unavailable``:
    field name -> why, from ``EngineCore.unavailable``). SamplingParams cannot check these: it
    knows neither the model, --max-logprobs nor the backend."""
    for name, why in (unavailable or {}).items():
        if _asks(getattr(params, name, None)):
            raise InvalidRequestError(f"{name} is unavailable: {why}", param=name)
    for param, what, ids in (("stop_token_ids", "stop_token_ids", params.stop_token_ids or []),
                             ("allowed_token_ids", "allowed_token_ids", params.allowed_token_ids or []),
                             ("logit_bias", "logit_bias's token ids", params.logit_bias or {})):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"{what} must be below the vocabulary size {vocab_size}, got {bad[:3]}",
                                      param=param)
    most = min(max_logprobs, vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        asked = getattr(params, name)
        if asked is not None and asked > most:
            raise InvalidRequestError(f"{name} {asked} is more than this engine returns: at most {most} "
                                      f"(--max-logprobs)", param=name)


def _asks(value: object) -> bool:
    """Whether a sampling field's value asks for anything: prompt_logprobs=0 does (the prompt's
    own logprobs), an empty logit_bias or bad_words list does not."""
    if isinstance(value, (dict, list, tuple, str)):
        return bool(value)
    return value is not None and value is not False


def check_cache_salt(salt: object) -> None:
    if not isinstance(salt, str) or not salt:
        raise InvalidRequestError("cache_salt must be a non-empty string")
    check_text("cache_salt", salt)  # it is hashed as UTF-8


def select_platform(config: EngineConfig, platform: Platform | None = None, registry=None) -> Platform:
    """The platform ``config`` runs on, bound to its runtime, once ``config`` is validated and
    checked against the platform's capabilities (filling in the defaults that depend on them):
    an unsupported request fails here with one sentence naming the flag and the backend, before
    anything loads. ``fd serve`` calls it before it starts the engine process too."""
    from fd_core.plugins import get_registry
    from fd_core.plugins.registry import bind_runtime

    config.validate()
    registry = registry or get_registry()
    # --runtime: the platform bound to the tensor library it runs on (None: its default)
    platform = (bind_runtime(platform, config.runtime) if platform is not None
                else registry.platform(config.device, config.runtime))
    others = {name: platform.with_runtime(name).capabilities()
              for name in getattr(platform, "runtimes", ()) if name != getattr(platform, "runtime", None)}
    config.check_against(platform.name, platform.capabilities(), others,
                         default_dtype=getattr(platform, "default_dtype", None))
    return platform


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform | None = None, registry=None) -> None:
        from fd_core.plugins import get_registry

        start = time.perf_counter()
        with phase("resolving the backend") as step:  # discovery imports the backends' hooks
            registry = registry or get_registry()
            self.platform = select_platform(config, platform, registry)
            step.detail = f"{self.platform.name}, runtime {self.platform.runtime}"
        self.capabilities = self.platform.capabilities()
        self.config = config

        with phase("reading the checkpoint") as step:
            checkpoint = open_checkpoint(config)
            step.detail = describe(checkpoint)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        # the checkpoint of the speculative proposer's own model, if it has one, and the shape of
        # its KV cache (layers, key-value heads, head size)
        proposer_source = open_proposer(config, checkpoint)
        self._proposer_cache = proposer_cache_shape(config, checkpoint, proposer_source)
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ConfigError(
                f"--max-model-len {config.max_model_len} exceeds the model's context length {model_len}"
            )
        self.max_model_len = config.max_model_len or model_len
        config.resolve_budget(self.max_model_len, getattr(self.platform, "default_max_num_batched_tokens", None),
                              getattr(self.platform, "default_long_prefill_token_threshold", None))

        config.max_model_len = self.max_model_len
        own = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()  # skip_tokenizer_init
        self.eos_token_ids = frozenset(own) | frozenset(self.model_config.eos_token_ids)

        world = config.tensor_parallel_size
        self.tp = TensorParallel(0, world, expert_parallel=config.enable_expert_parallel)
        self.tp.check(self.model_config, moe_spec(self.model_config))  # before any process starts
        if world == 1:
            runner = load_runner(config, self.platform, registry, checkpoint=checkpoint,
                                 proposer_source=proposer_source)
            self.executor = Executor(config.block_size, self.eos_token_ids, runner=runner)
            self.memory, self.ops = runner.memory, runner.ops
        else:
            # rank 0 logs its loading; the others only their warnings (fd_core.logs.rank_level)
            with phase(f"starting {world} tensor-parallel ranks"):
                workers = Workers(dataclasses.replace(config, device=self.platform.name, runtime=self.platform.runtime),
                                  world, rendezvous_address(world))
                try:
                    workers.wait(timeout=900)  # every rank has loaded its shard
                except BaseException:
                    workers.close()
                    raise
            self.executor = Executor(config.block_size, self.eos_token_ids, workers=workers)
            # the ranks hold the model and the device memory; this process touches neither (on a
            # GPU, a Memory here would open a device context beside rank 0's)
            self.memory, self.ops = None, None

        with phase("sizing the KV cache") as step:
            num_blocks = self._num_kv_blocks()  # profiles the device's memory where it can
            per_rank = " per rank" if world > 1 else ""
            step.detail = (f"{num_blocks} blocks of {config.block_size} tokens, "
                           f"{num_blocks * self._kv_block_bytes() / GiB:.2f} GiB{per_rank} in {config.cache_dtype}")
        if (num_blocks - 1) * config.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - 1) * config.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; give it more memory (kv_cache_memory_gb / "
                f"num_kv_blocks) or lower max_model_len"
            )
        # and the backend's warm-up (captured graphs), which logs its own phases
        with phase("allocating the KV cache"):
            self.executor.initialize_kv_cache(num_blocks, config.cache_dtype)
            # its bookkeeping too: O(blocks) in Python, 28 s for the 18.5 million blocks a tiny
            # model gets on an H100, which were otherwise silent before "engine ready"
            self.pool = BlockPool(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        swap = None
        if config.swap_space:
            num_host_blocks = int(config.swap_space * GiB // self._kv_block_bytes())
            if num_host_blocks < 1:
                raise ConfigError(f"--swap-space {config.swap_space} GiB holds less than one KV-cache block")
            self.executor.initialize_swap_space(num_host_blocks, config.cache_dtype)
            swap = SwapSpace(num_host_blocks)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, swap, config.long_prefill_token_threshold)
        self.seqs: dict[str, list[Sequence]] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self._in_flight: _InFlight | None = None
        self.grammars: GrammarMatchers | None = None  # made for the first structured-output request
        self._masks: MaskWorker | None = None  # the grammar thread, where masks are deferred
        self._unavailable: dict[str, str] | None = None  # unavailable(), once asked
        self._scoring: set[Sequence] = set()  # sequences that owe prompt logprobs
        self._prefilled: list[Sequence] = []  # hand_over sequences past their first token
        if config.async_scheduling is None:
            self.async_scheduling = self.executor.can_launch
        else:
            self.async_scheduling = config.async_scheduling
        if self.async_scheduling and not self.executor.can_launch:
            raise ConfigError(f"--async-scheduling: the {self.platform.name} backend has no sample_async op "
                              f"for this model (fd doctor lists its ops)")
        self.num_scheduler_steps = config.num_scheduler_steps
        if self.num_scheduler_steps > 1 and not self.async_scheduling:
            raise ConfigError(f"--num-scheduler-steps {self.num_scheduler_steps}: a round's steps take their "
                              f"input tokens from the step before on the device, and the {self.platform.name} "
                              f"backend has no sample_async op for this model (fd doctor lists its ops)")
        self.proposer: Proposer | None = None
        self._pad_drafts = False
        spec = config.speculative_config
        if spec is not None:
            if spec.method == "ngram":
                self.proposer = NgramProposer(spec, self.max_model_len)
            else:
                self.proposer = ModelProposer(spec, self.max_model_len, self.pool, self.executor.propose,
                                              lambda: len(self.scheduler.running))
            self.scheduler.proposer_kv = self.proposer.holds_kv
            # the backend replays verification steps of one shape: every decoding sequence gets k drafts
            self._pad_drafts = self.executor.pads_drafts()
            if self.async_scheduling:  # validate() refused it asked for: it was the default
                startup.info("speculative decoding (%s): asynchronous scheduling is off, since a step's drafts "
                             "come from the tokens the step before accepted", spec.method)
                self.async_scheduling = False
        # prompt_tokens_computed counts prompt tokens the model ran (prefix-cache hits and forks
        # skip some, recomputation after preemption repeats some)
        # steps: device steps (a round of decode steps counts each); rounds: those of more than one
        self.stats = {"prompt_tokens": 0, "prompt_tokens_computed": 0, "generation_tokens": 0, "steps": 0,
                      "rounds": 0, "preemptions": 0, "kv_import_seconds": 0.0}
        if spec is not None:  # vLLM's spec_decode counters: sequence-steps with drafts, drafts, accepted
            self.stats.update(spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0,
                              spec_accepted_per_pos=[0] * spec.num_speculative_tokens)
        startup.info("engine ready in %.2f s: %s on %s, max_model_len %d, %d KV-cache blocks",
                     time.perf_counter() - start, config.model, self.platform.name, self.max_model_len, num_blocks)

    def _kv_block_bytes(self) -> int:
        """Bytes of one block on one rank (a tensor-parallel rank holds its share of the heads)."""
        c, m = self.config, self.model_config
        caches = [(m.num_hidden_layers, m.num_key_value_heads, m.head_dim)]
        if self._proposer_cache is not None:  # its layers are in the same blocks
            caches.append(self._proposer_cache)
        return sum(2 * layers * c.block_size * (heads // self.tp.world_size) * kv_row_bytes(c.cache_dtype, head_dim)
                   for layers, heads, head_dim in caches)

    def _num_kv_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = self._kv_block_bytes()
        if c.kv_cache_memory_gb is None and self.capabilities.memory_profiling:
            return self._profiled_kv_blocks(per_block)
        budget = (c.kv_cache_memory_gb or DEFAULT_KV_CACHE_MEMORY_GB) * GiB
        # a backend that cannot say how much is free (memory_query) gets the budget as asked
        free, _ = self.executor.memory_info() if self.capabilities.memory_query else (0, 0)
        if free:
            budget = min(budget, free // 2)
        return max(2, int(budget // per_block))

    def _profiled_kv_blocks(self, per_block: int) -> int:
        """``gpu_memory_utilization`` of each device, less what is in use after loading (weights,
        runtime context, other processes) and the peak of the largest step, in KV blocks; the
        smallest over the ranks."""
        c = self.config
        utilization = c.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
        blocks, tightest = [], None
        # the most rows a step samples: one per sequence, and one per draft it verifies
        rows = c.max_num_seqs
        if c.speculative_config is not None:
            rows = min(c.max_num_batched_tokens, rows * (1 + c.speculative_config.num_speculative_tokens))
        for free, total, peak in self.executor.profile_memory(
            c.max_num_batched_tokens, rows, self.max_model_len, c.cache_dtype
        ):
            budget = total * utilization - (total - free) - peak
            blocks.append(int(budget // per_block))
            if tightest is None or budget < tightest[0]:
                tightest = (budget, total, total - free, peak)
            log.info("KV cache: %.2f GiB of %.2f GiB at --gpu-memory-utilization %.2f (in use %.2f GiB, "
                     "step peak %.2f GiB)", max(budget, 0) / GiB, total / GiB, utilization,
                     (total - free) / GiB, peak / GiB)
        if min(blocks) < 2:
            _, total, used, peak = tightest
            raise ConfigError(
                f"--gpu-memory-utilization {utilization}: no device memory is left for the KV cache: "
                f"{utilization * total / GiB:.2f} GiB of the device's {total / GiB:.2f} GiB, less {used / GiB:.2f} GiB "
                f"in use after loading (the model, and whatever other processes or engines hold) and the "
                f"largest step's {peak / GiB:.2f} GiB; raise it, free the device, or lower "
                f"--max-num-batched-tokens / --max-num-seqs"
            )
        return min(blocks)

    def check_prompt(self, token_ids: list[int]) -> None:
        check_prompt(token_ids, self.model_config.vocab_size, self.max_model_len,
                     self.config.max_num_batched_tokens, self.config.enable_chunked_prefill)

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    cache_salt: str | None = None, hand_over: bool = False,
                    prefilled: Prefilled | None = None) -> list[int]:
        """Queue a request; returns its prompt as the core holds it (a list of Python ints,
        checked). ``cache_salt`` keeps its prefix-cache entries apart from those of
        requests with another salt (tenants that must not learn each other's prompts).

        Prefill/decode disaggregation: ``hand_over`` (a prefill instance) stops the request
        once its first token is sampled, holding its blocks (``prefilled``, ``release``);
        ``prefilled`` (a decode instance) continues one computed elsewhere from that token.
        A request with ``n > 1`` is not handed over: it runs here whole."""
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = token_id_list(token_ids)
        self.check_prompt(token_ids)
        check_params(params, self.model_config.vocab_size, self.config.max_logprobs, self.unavailable())
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        grammar = None
        if params.structured_outputs:
            after = ()
            if params.structured_outputs.starts_after:
                after = tuple(self.tokenizer.encode(params.structured_outputs.starts_after, add_special_tokens=False))
            grammar = self._structured().grammar(params.structured_outputs, after)
        allowed = None
        if params.allowed_token_ids:
            row = np.zeros((1, self.model_config.vocab_size), dtype=bool)
            row[0, params.allowed_token_ids] = True
            allowed = pack_token_bitmask(row)[0]
        words = tokenize_bad_words(self.tokenizer, params.bad_words) if params.bad_words else ()
        history = params.penalised or needs_history(words)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**62))
        seqs = []
        now = time.monotonic()
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=i,
                prompt_token_ids=token_ids, params=params,
                seed=(base_seed + i * _SEED_MIX) % (2**63), arrival=next(self._arrivals),
                max_tokens=max_tokens, cache_salt=cache_salt, queued_at=now,
                grammar=None if grammar is None else grammar.fork() if i else grammar,
                allowed_tokens=allowed, bad_words=words, reads_history=history,
            )
            seqs.append(seq)
        if prefilled is not None:
            self._continue(seqs, prefilled)
            return token_ids
        if hand_over and self.async_scheduling:
            raise ConfigError("handing requests over after their prefill needs --async-scheduling off")
        seqs[0].hand_over = hand_over and params.n == 1
        # the first computes the prompt; the others fork from it (Scheduler.fork)
        seqs[0].forks = seqs[1:]
        if params.prompt_logprobs is not None:
            seqs[0].prompt_scored = 1  # the first token has no logprob
            if seqs[0].owes_prompt_logprobs:
                self._scoring.add(seqs[0])
        for child in seqs[1:]:
            child.fork_of = seqs[0]
        self.scheduler.add(seqs[0])
        self.seqs[request_id] = seqs
        self.stats["prompt_tokens"] += len(token_ids) * params.n
        return token_ids

    def _continue(self, seqs: list[Sequence], prefilled: Prefilled) -> None:
        """Queue a sequence whose prompt was computed on a prefill instance, from its first
        token on: it is admitted with the transferred keys and values (Scheduler) and computes
        no prompt token here; the prefill instance counted the prompt."""
        if len(seqs) != 1:
            raise InvalidRequestError("a request handed over from a prefill instance has one sequence (n=1)")
        seq = seqs[0]
        token = int(prefilled.first_token)
        if not 0 <= token < self.model_config.vocab_size:
            raise InvalidRequestError(f"a handed-over first token {token} outside the vocabulary")
        seq.output_token_ids = [token]
        seq.seed = prefilled.seed
        seq.num_cached_tokens = prefilled.num_cached_tokens
        seq.kv_import = prefilled.kv
        if seq.grammar is not None:
            seq.grammar.advance(token)
        self.scheduler.add(seq)
        self.seqs[seq.request_id] = seqs

    def prefilled(self) -> list[Sequence]:
        """The ``hand_over`` sequences whose first token came out and that wait, out of
        scheduling and holding their blocks, to be ``release``d once sent on."""
        return list(self._prefilled)

    def export_kv(self, seq: Sequence, on_device: bool = False) -> list:
        """The keys and values of ``seq``'s prompt as host arrays (``on_device``: the Memory's
        device tensors), per rank: what a decode instance's ``Prefilled.kv`` takes."""
        blocks = -(-len(seq.prompt_token_ids) // self.config.block_size)
        return self.executor.export_kv(seq.block_table[:blocks], on_device)

    def release(self, seq: Sequence) -> None:
        """Forget a handed-over sequence, freeing its blocks (full ones stay in the prefix
        cache); its request's outputs continue elsewhere."""
        self.scheduler.finish(seq)
        if seq in self._prefilled:
            self._prefilled.remove(seq)
        seq.status, seq.finish_reason, seq.grammar = Status.FINISHED, "handed_over", None
        self.seqs.pop(seq.request_id, None)

    def unavailable(self) -> dict[str, str]:
        """The sampling fields this engine cannot honour, each with why (``check_params``);
        asked of the ranks' op tables once."""
        if self._unavailable is None:
            out = {}
            for since, names in (("1.10", ("structured_outputs", "allowed_token_ids")), ("1.11", ("logit_bias",))):
                why = self.executor.sample_lacks(since)
                if why:
                    out.update(dict.fromkeys(names, f"on the {self.platform.name} backend, {why}"))
            if self.tokenizer is None:
                why = "it needs the model's tokenizer, and this engine was started without one (skip_tokenizer_init)"
                out["structured_outputs"] = out["bad_words"] = why
            why = self.executor.scores_lack()
            if why:
                out["prompt_logprobs"] = f"on the {self.platform.name} backend, {why}"
            self._unavailable = out
        return self._unavailable

    def _structured(self) -> GrammarMatchers:
        """The engine's grammar matchers, made on first use (building llguidance's view of the
        tokenizer takes a quarter to half a second; check_params has refused what cannot run)."""
        if self.grammars is not None:
            return self.grammars
        start = time.perf_counter()
        self.grammars = GrammarMatchers(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        log.info("structured output: llguidance read the tokenizer in %.2f s", time.perf_counter() - start)
        if self.async_scheduling and self.executor.can_defer:
            self._masks = MaskWorker(self.grammars)
        return self.grammars

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop one sequence of a request (``index``) or all of them, freeing their blocks."""
        seqs = self.seqs.get(request_id, [])
        for seq in seqs:
            if (index is None or seq.index == index) and not seq.finished:
                while seq.output_token_ids and seq.output_token_ids[-1] == PLACEHOLDER:  # never read
                    seq.output_token_ids.pop()
                self.scheduler.finish(seq)
                self._scoring.discard(seq)
                if seq in self._prefilled:
                    self._prefilled.remove(seq)
                seq.status, seq.finish_reason, seq.grammar = Status.FINISHED, "abort", None
        if all(s.finished for s in seqs):
            self.seqs.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    @property
    def num_requests(self) -> int:
        return len(self.seqs)

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Run one scheduled step; return one CoreOutput per sequence that sampled a token.

        With asynchronous scheduling the step is queued on the device and the tokens returned
        are the previous step's, read while this one computes: a sequence's input token for
        this step is taken on the device from that previous sample (its host copy is
        ``PLACEHOLDER`` until read). A sequence that ended on the previous step's token (EOS, a
        stop id, an abort) has computed one more step for nothing; its extra token is dropped.
        Steps whose next schedule needs the tokens on the host (penalties read the output so
        far; ``n > 1`` forks) are read before the next step is scheduled."""
        outputs: list[CoreOutput] = []
        if self._in_flight is not None and self._in_flight.read_first:
            outputs = self._land()
        out = self.scheduler.schedule()
        self.stats["preemptions"] += len(out.preempted)
        if out.swap_out:
            self.executor.swap_out(out.swap_out)
        if out.swap_in:
            self.executor.swap_in(out.swap_in)
        if out.kv_import:
            began = time.perf_counter()
            for blocks, first, kv in out.kv_import:
                self.executor.import_kv(blocks, first, kv)
            self.stats["kv_import_seconds"] += time.perf_counter() - began
        if not out.scheduled:
            if self._in_flight is not None:  # e.g. every running sequence awaits its last token
                return outputs + self._land()
            if self.scheduler.has_work() and not out.preempted:
                raise RuntimeError("the scheduler made no progress; this is a bug in fd")
            return outputs
        parents = [s for s in out.scheduled if s.seq.forks and s.samples]
        self.stats["steps"] += 1
        self._account_step(out)
        grammars = self.grammars
        score = bool(self._scoring)
        if not self.async_scheduling:
            result = self.executor.execute(out.scheduled, grammars.fill if grammars else None, score)
            if self.proposer is not None:
                return self._speculative(out, parents, result)
            self._advance(out, parents)
            self._keep_scores(result.scored, result.prompt)
            return self._apply(result.sampled, result.output)
        previous = self._in_flight
        fill = None
        masks = self._masks
        deferred = False
        if grammars is not None:
            def fill(sampled: list[Sequence], batch) -> None:
                nonlocal previous, deferred
                # every row with a grammar: one still waiting for its start may wake on the
                # token of the step in flight, which is not advanced yet
                rows = [(s.grammar, row) for row, s in enumerate(sampled) if s.grammar is not None]
                deferred = masks is not None and len(rows) >= DEFER_ROWS
                # A constrained row's mask needs its sequence's previous token, sampled by the
                # step in flight: read that step now, while the forward just queued computes,
                # unless the grammar thread advances it before it fills this step's masks.
                if previous is not None and rows and (not deferred or previous.advance is None):
                    outputs.extend(self._read(previous))
                    previous = None
                if deferred:  # the device holds the sample until the grammar thread has filled it
                    mask = self.executor.deferred_bitmask(len(sampled), grammars.words)
                    masks.fill(rows, mask, batch.allowed_token_bitmask)
                    batch.allowed_token_bitmask = mask
                else:
                    grammars.fill(sampled, batch)
        steps = 1
        if self.num_scheduler_steps > 1 and not self.scheduler.waiting and not score:
            steps = round_steps(out.scheduled, self.num_scheduler_steps, self.max_model_len)
            if steps > 1 and not self.scheduler.reserve_ahead(out, steps):
                steps = 1
        if steps > 1:
            self.stats["steps"] += steps - 1
            self.stats["rounds"] += 1
        round_ = self.executor.launch(out.scheduled, self._in_flight.last if self._in_flight else None, fill,
                                      score, steps)
        launched = round_[0]
        self._keep_scores(launched.scored, launched.prompt)  # before the first token they go with
        placed = []
        for one in round_:
            slots = []
            for seq in one.sampled:
                slots.append(len(seq.output_token_ids))
                if not seq.finished:  # one that ended on the token just read gets none
                    seq.output_token_ids.append(PLACEHOLDER)
            placed.append((one, slots))
        read_first = bool(parents) or any(s.reads_history for s in launched.sampled)
        advance = None
        if deferred and launched.pending is not None:
            advance = masks.advance([s.grammar for s in launched.sampled], launched.pending)
        self._in_flight = _InFlight(launched, placed[0][1], read_first, advance, placed[1:])
        if previous is not None:  # read while the device computes the step just queued
            outputs += self._read(previous)
        self._advance(out, parents, steps)
        return outputs

    def _speculative(self, out: SchedulerOutput, parents: list[ScheduledSeq], result: StepResult) -> list[CoreOutput]:
        """A step with a proposer: each sequence that verified drafts keeps the rows up to the
        first draft the target rejected (``speculative/verify.py``) and gives the rejected
        drafts' blocks back; the step's tokens go into the sequences before the proposer runs
        (its drafts follow them) and before the step's blocks are published (a block's tokens
        are the accepted ones); then each row is applied as a sampled token."""
        sampled, o = result.sampled, result.output
        decoding = [s.seq for s in out.scheduled if s.samples]  # before the step's tokens lengthen them
        keep = None
        if o is not None and any(s.drafts for s in out.scheduled):
            keep = self._verify(out, o.token_ids)
            sampled = [seq for seq, kept in zip(sampled, keep) if kept]
            o = SampleOutput(o.token_ids[keep], o.logprobs[keep], o.ranks[keep], o.top_ids[keep], o.top_logprobs[keep])
        slots = []
        if o is not None:
            for seq, token in zip(sampled, o.token_ids.tolist()):
                slots.append(len(seq.output_token_ids))
                seq.output_token_ids.append(token)
        for s in out.scheduled:
            s.seq.draft_token_ids = []  # verified: the proposer makes the next ones
            if s.rejected:
                self.scheduler.roll_back(s.seq)
        self.proposer.propose(out.scheduled, decoding)
        if self._pad_drafts:
            pad_drafts(decoding, self.config.speculative_config.num_speculative_tokens, self.max_model_len)
        self._advance(out, parents)
        self._keep_scores(result.scored, result.prompt)
        return self._apply(sampled, o, slots)

    def _verify(self, out: SchedulerOutput, tokens: np.ndarray) -> np.ndarray:
        """Which rows of the step's sample hold a token to emit; sets each speculating
        sequence's ``rejected`` and counts the drafts (``stats``)."""
        starts, spec, row = [], [], 0
        for s in out.scheduled:
            if s.drafts and s.samples:
                starts.append(row)
                spec.append(s)
            row += s.num_rows
        good = accepted(tokens, np.asarray(starts, dtype=np.int64), [s.drafts for s in spec])
        keep = np.ones(row, dtype=bool)
        per_pos = self.stats["spec_accepted_per_pos"]
        for s, start, a in zip(spec, starts, good.tolist()):
            k = len(s.drafts)
            keep[start + a + 1 : start + k + 1] = False
            s.rejected = k - a
            for j in range(a):
                per_pos[j] += 1
        self.stats["spec_drafts"] += len(spec)
        self.stats["spec_draft_tokens"] += sum(len(s.drafts) for s in spec)
        self.stats["spec_accepted_tokens"] += int(good.sum())
        return keep

    def _land(self) -> list[CoreOutput]:
        """Read and apply the step in flight, taking it out of flight."""
        flight, self._in_flight = self._in_flight, None
        return self._read(flight)

    def _read(self, flight: _InFlight) -> list[CoreOutput]:
        pending = flight.launched.pending
        if pending is None:
            return []
        output = pending.result()
        ended = flight.advance.wait() if flight.advance is not None else None
        # a round's later steps sample the same rows (the executor's one list)
        later = [(launched.pending.result(), slots) for launched, slots in flight.later]
        return self._apply(flight.launched.sampled, output, flight.slots, ended, later)

    def _account_step(self, out: SchedulerOutput) -> None:
        """Count the step's prompt tokens, note when a sequence is first scheduled (a sequence
        with prompt left to compute), and refuse to run it past the engine's limits: its
        tokens plus the rows of the forks it seats within the budget, the running sequences
        plus those forks (and so the rows it samples) within max_num_seqs. The scheduler never
        builds such a step (``tests/test_scheduler_properties.py``); this catches a regression
        before it costs a step of unbounded length, for two sums over the scheduled sequences."""
        computed = 0
        for s in out.scheduled:
            prompt = len(s.seq.prompt_token_ids)
            if s.seq.num_computed < prompt:
                computed += min(s.seq.num_computed + s.num_new, prompt) - s.seq.num_computed
                if s.seq.scheduled_at is None:
                    s.seq.scheduled_at = time.monotonic()
        self.stats["prompt_tokens_computed"] += computed
        tokens, forks = out.num_tokens, out.num_forks
        c, running = self.config, len(self.scheduler.running)
        if (tokens + forks > c.max_num_batched_tokens or running + forks > c.max_num_seqs
                or len(out.scheduled) > running):
            raise RuntimeError(
                f"the scheduler exceeded its limits: {tokens} tokens and {forks} forks for a budget of "
                f"{c.max_num_batched_tokens}, {len(out.scheduled)} scheduled of {running} running with "
                f"max_num_seqs={c.max_num_seqs}; this is a bug in fd")

    def _keep_scores(self, scored: Scored, prompt: SampleOutput | None) -> None:
        """Hold what a step scored of each prompt (prompt_logprobs) until its first token."""
        row = 0
        for seq, first, end in scored:
            if first != seq.prompt_scored:
                raise RuntimeError(f"prompt logprobs from token {first} of a sequence that has {seq.prompt_scored}; "
                                   f"this is a bug in fd")
            k = seq.params.prompt_logprobs
            seq.prompt_scores.append((prompt.logprobs[row : row + end - first], prompt.ranks[row : row + end - first],
                                      prompt.top_ids[row : row + end - first, :k],
                                      prompt.top_logprobs[row : row + end - first, :k]))
            seq.prompt_scored = end
            if not seq.owes_prompt_logprobs:
                self._scoring.discard(seq)
            row += end - first

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> PromptLogprobs:
        """What the steps scored of ``seq``'s prompt, as one (and no longer held)."""
        if seq.owes_prompt_logprobs:
            raise RuntimeError(f"a first token before prompt token {seq.prompt_scored} was scored; this is a bug in fd")
        parts, seq.prompt_scores = seq.prompt_scores, []
        if not parts:  # a one-token prompt
            return PromptLogprobs([], [], [])
        logprobs, ranks, top_ids, top_logprobs = (np.concatenate(column) for column in zip(*parts))
        return PromptLogprobs(logprobs.tolist(), ranks.tolist(),
                              [list(zip(i, lp)) for i, lp in zip(top_ids.tolist(), top_logprobs.tolist())])

    def _advance(self, out: SchedulerOutput, parents: list[ScheduledSeq], steps: int = 1) -> None:
        self.scheduler.advance(out, steps)
        copies = []
        for s in parents:  # the forks it seated sampled from its logits: now they run on their own
            copies += self.scheduler.fork(s)
        self.executor.copy_blocks(copies)

    def _apply(self, sampled: list[Sequence], o: SampleOutput | None, slots: list[int] | None = None,
               ended: list[str | None] | None = None,
               later: list[tuple[SampleOutput, list[int]]] = ()) -> list[CoreOutput]:
        """Record each row's token. ``slots``: where each row's placeholder sits in its
        sequence's output (asynchronous scheduling); None: append. ``ended``: per row, why its
        grammar ends its sequence, where the grammar thread advanced the grammars (None: they
        are advanced here). ``later``: a round's later steps over the same rows, each with its
        slots (engine/rounds.py: no grammar, no first token): a row's tokens of the whole round
        go out as one CoreOutput."""
        if o is None:
            return []
        outputs = []
        # Python scalars once per array, not one NumPy scalar per row
        tokens, logprobs, ranks, top_ids, top_logprobs = _columns(o)
        rounds = [(*_columns(step), at) for step, at in later]
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        later_tokens = 0
        for row, seq in enumerate(sampled):
            token = tokens[row]
            if slots is None:
                seq.output_token_ids.append(token)
                count = len(seq.output_token_ids)
            elif seq.status is Status.FINISHED:  # it ended (or was aborted) while this step computed,
                continue  # or on an earlier row of this step (speculative decoding)
            else:
                seq.output_token_ids[slots[row]] = token
                count = slots[row] + 1
            p = seq.params
            wants = p.logprobs is not None
            each = wants or bool(p.stop_strings)  # per-token logprobs (see CoreOutput)
            k = p.logprobs or 0
            output = CoreOutput(seq.request_id, seq.index, [token], logprobs[row],
                                [logprobs[row]] if each else _NONE, [ranks[row]] if wants else _NONE,
                                [list(zip(top_ids[row][:k], top_logprobs[row][:k]))] if k else _NONE,
                                num_cached_tokens=max(0, seq.num_cached_tokens))
            if count == 1:
                if seq.scheduled_at is not None:
                    output.time_in_queue = seq.scheduled_at - seq.queued_at
                    output.prefill_time = time.monotonic() - seq.scheduled_at
                if seq.prompt_scored is not None:
                    output.prompt_logprobs = self._prompt_logprobs(seq)
            if ended is not None:  # advanced on the grammar thread
                grammar = ended[row]
            else:
                grammar = None if seq.grammar is None else seq.grammar.advance(token)
            if (grammar or token in eos or p.stop_token_ids or count >= seq.max_tokens
                    or len(seq.prompt_token_ids) + count >= max_model_len):  # it may end here
                self._check_finish(seq, token, output, count, grammar)
            if seq.hand_over and count == 1 and not seq.finished:  # its decode continues elsewhere
                self.scheduler.running.remove(seq)
                self._prefilled.append(seq)
            outputs.append(output)
            if not rounds:
                continue
            for step_tokens, step_logprobs, step_ranks, step_top_ids, step_top_logprobs, at in rounds:
                if seq.status is Status.FINISHED:  # on an earlier token of the round
                    break
                later_tokens += 1
                token = step_tokens[row]
                seq.output_token_ids[at[row]] = token
                count = at[row] + 1
                output.token_ids.append(token)
                output.logprob += step_logprobs[row]
                if each:
                    output.logprobs.append(step_logprobs[row])
                if wants:
                    output.ranks.append(step_ranks[row])
                if k:
                    output.top.append(list(zip(step_top_ids[row][:k], step_top_logprobs[row][:k])))
                # as the first token's test: a round has no grammar (round_steps)
                if (token in eos or p.stop_token_ids or count >= seq.max_tokens
                        or len(seq.prompt_token_ids) + count >= max_model_len):
                    self._check_finish(seq, token, output, count)
        self.stats["generation_tokens"] += len(outputs) + later_tokens
        return outputs

    def _check_finish(self, seq: Sequence, token: int, output: CoreOutput, count: int,
                      grammar: str | None = None) -> None:
        """``token`` is the ``count``-th of ``seq``'s output; ``grammar``: why its grammar ends
        the sequence here, if it does (``Grammar.advance``)."""
        p = seq.params
        reason = None
        if grammar is not None:
            reason = grammar
        elif count >= p.min_tokens and not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif count >= p.min_tokens and p.stop_token_ids and token in p.stop_token_ids:
            reason, output.stop_reason = "stop", token
        elif count >= seq.max_tokens or len(seq.prompt_token_ids) + count >= self.max_model_len:
            reason = "length"
        if reason is not None:
            del seq.output_token_ids[count:]  # a placeholder of a step still in flight
            seq.status, seq.finish_reason, output.finish_reason = Status.FINISHED, reason, reason
            seq.grammar = None
            self.scheduler.finish(seq)
            if all(s.finished for s in self.seqs[seq.request_id]):
                self.seqs.pop(seq.request_id, None)

    def shutdown(self) -> None:
        """Stop the grammar thread and the tensor-parallel workers, if any, and give the frozen
        start-up heap back to the collector (idempotent)."""
        if self._masks is not None:
            self._masks.close()
        self.executor.close()
        thaw_heap()

    def kv_usage(self) -> float:
        return self.pool.usage()

    def cache_stats(self) -> dict[str, float]:
        """Prefix-cache and preemption figures for metrics."""
        pool, sched = self.pool, self.scheduler
        return {
            "prefix_cache_queried_tokens": pool.queried_tokens,
            "prefix_cache_hit_tokens": pool.hit_tokens,
            "prefix_cache_hit_rate": pool.hit_rate(),
            "prefix_cache_blocks": pool.num_cached,
            "prefix_cache_evictions": pool.evictions,
            "swapped_out": sched.num_swapped_out,
            "recomputed": sched.num_recomputed,
            "num_swapped": sched.num_swapped,
        }
