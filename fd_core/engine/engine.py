"""The engine core: requests in, one scheduled step at a time, outputs out.

Runtime-free: it reaches the chip only through the Platform it was given (Memory, op table)
and the shared ModelRunner.
"""

from __future__ import annotations

import itertools
import logging
import numpy as np

from fd_core.engine import detokenizer
from fd_core.engine.block_pool import BlockPool
from fd_core.engine.config import GiB, EngineConfig
from fd_core.engine.model_runner import ModelRunner, StepResult
from fd_core.engine.outputs import CompletionOutput, Logprob, RequestOutput
from fd_core.engine.sampling_params import SamplingParams
from fd_core.engine.scheduler import Scheduler
from fd_core.engine.sequence import Request, Sequence, Status
from fd_core.errors import ConfigError, InvalidRequestError, PromptTooLongError
from fd_core.interfaces import Platform

log = logging.getLogger("fd.engine")

_SEED_MIX = 0x9E3779B97F4A7C15  # odd constant so seed+index streams do not collide


class LLMEngine:
    def __init__(self, config: EngineConfig, platform: Platform | None = None, registry=None) -> None:
        from fd_core.loader import load_checkpoint, resolve_model
        from fd_core.models import build_model
        from fd_core.plugins import get_registry

        config.validate()
        registry = registry or get_registry()
        self.platform = platform or registry.platform(config.device)
        self.capabilities = self.platform.capabilities()
        config.check_against(self.platform.name, self.capabilities)
        self.config = config

        path = resolve_model(config.model)
        checkpoint = load_checkpoint(path)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise ConfigError(
                f"--max-model-len {config.max_model_len} exceeds the model's context length {model_len}"
            )
        self.max_model_len = config.max_model_len or model_len

        self.memory = self.platform.memory(0)
        self.ops = registry.op_table(
            self.platform,
            context={"dtype": config.dtype, "head_dim": self.model_config.head_dim, "quantization": None},
            pins=config.op_pins,
        )
        model = build_model(self.model_config, self.ops, self.memory, self.max_model_len, config.dtype)
        model.load_weights(checkpoint.weights())
        eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.eos_token_ids = eos
        self.runner = ModelRunner(model, self.ops, self.memory, config.block_size, eos,
                                  self.platform.runner_hooks())

        num_blocks = self._num_kv_blocks()
        if (num_blocks - 1) * config.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {(num_blocks - 1) * config.block_size} tokens, fewer than "
                f"max_model_len={self.max_model_len}; give it more memory (kv_cache_memory_gb / "
                f"num_kv_blocks) or lower max_model_len"
            )
        self.runner.initialize_kv_cache(num_blocks, config.dtype)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.pool, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = np.random.default_rng(config.seed)
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0}

    def _num_kv_blocks(self) -> int:
        c, m = self.config, self.model_config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        dtype_bytes = 2 if c.dtype in ("bfloat16", "float16") else 4
        per_block = 2 * m.num_hidden_layers * c.block_size * m.num_key_value_heads * m.head_dim * dtype_bytes
        budget = c.kv_cache_memory_gb * GiB
        free, _ = self.memory.memory_info()
        if free:
            budget = min(budget, free // 2)
        return max(2, int(budget // per_block))

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prompt_text: str | None = None) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            prompt_text = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = [int(t) for t in prompt]
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if not self.config.enable_chunked_prefill and len(token_ids) > self.config.max_num_batched_tokens:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids)} tokens, more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens}, and chunked prefill is off"
            )
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**62))
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=i,
                prompt_token_ids=list(token_ids), params=params,
                seed=(base_seed + i * _SEED_MIX) % (2**63), arrival=next(self._arrivals),
                max_tokens=max_tokens,
            )
            detokenizer.start(seq)
            seqs.append(seq)
            self.scheduler.add(seq)
        request = Request(request_id, prompt_text, list(token_ids), params, seqs)
        self.requests[request_id] = request
        self.stats["prompt_tokens"] += len(token_ids) * params.n
        return request

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.finished:
                self.scheduler.abort(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of requests that changed."""
        out = self.scheduler.schedule()
        self.stats["preemptions"] += len(out.preempted)
        if not out.scheduled:
            if self.scheduler.has_work() and not out.preempted:
                raise RuntimeError("the scheduler made no progress; this is a bug in fd")
            return []
        result = self.runner.execute(out.scheduled)
        self.stats["steps"] += 1
        for s in out.scheduled:
            s.seq.num_computed += s.num_new
        touched = self._apply(result)
        return [self._output(self.requests[rid]) for rid in touched if rid in self.requests]

    def _apply(self, result: StepResult) -> list[str]:
        touched: dict[str, None] = {}
        if result.output is None:
            return []
        o = result.output
        for row, s in enumerate(result.sampled):
            seq = s.seq
            token = int(o.token_ids[row])
            seq.output_token_ids.append(token)
            self.stats["generation_tokens"] += 1
            seq.cumulative_logprob += float(o.logprobs[row])
            if seq.params.logprobs is not None:
                seq.logprobs.append(self._logprob_entry(o, row, token, seq.params.logprobs))
            new_text = detokenizer.append_text(self.tokenizer, seq)
            self._check_finish(seq, token, len(new_text))
            touched[seq.request_id] = None
        return list(touched)

    def _logprob_entry(self, o, row: int, token: int, k: int) -> dict[int, Logprob]:
        entry = {token: Logprob(float(o.logprobs[row]), int(o.ranks[row]), self.tokenizer.decode([token], skip_special_tokens=False))}
        for rank, (tid, lp) in enumerate(zip(o.top_ids[row][:k], o.top_logprobs[row][:k]), start=1):
            tid = int(tid)
            if tid not in entry:
                entry[tid] = Logprob(float(lp), rank, self.tokenizer.decode([tid], skip_special_tokens=False))
        return entry

    def _check_finish(self, seq: Sequence, token: int, new_text_len: int) -> None:
        p = seq.params
        reason, stop_reason = None, None
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                reason = "stop"
            elif p.stop_token_ids and token in p.stop_token_ids:
                reason, stop_reason = "stop", token
            else:
                stop = detokenizer.find_stop(seq, new_text_len)
                if stop is not None:
                    reason, stop_reason = "stop", stop
        if reason is None and (n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop_reason
            self.scheduler.finish(seq)

    def _output(self, request: Request) -> RequestOutput:
        outs = []
        for seq in request.seqs:
            outs.append(CompletionOutput(
                index=seq.index, text=seq.text, token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
        finished = request.finished
        if finished:
            self.requests.pop(request.request_id, None)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs, finished)

    def run(self, progress=None) -> dict[str, RequestOutput]:
        """Step until every request is done; returns the final output of each."""
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step():
                if output.finished:
                    done[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        return done

    def kv_usage(self) -> float:
        return self.pool.usage()
