"""LLMEngine: the engine core and the output processor in one process (the offline ``LLM``).

``fd serve`` puts a process boundary between the two; here they are called directly.
"""

from __future__ import annotations

from fd_core.engine.config import EngineConfig
from fd_core.engine.core import EngineCore
from fd_core.engine.output_processor import OutputProcessor
from fd_core.engine.outputs import RequestOutput
from fd_core.engine.prompts import encode_prompt
from fd_core.engine.sampling_params import SamplingParams
from fd_core.errors import InvalidRequestError
from fd_core.heap import freeze_startup_heap
from fd_core.interfaces import Platform


class LLMEngine:
    def __init__(self, config: EngineConfig, platform: Platform | None = None, registry=None) -> None:
        self.core = EngineCore(config, platform, registry)
        self.tokenizer = self.core.tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        # as fd serve's processes do: the engine runs in this process, whose full collections
        # would otherwise walk every library and module start-up built (~100 ms each, a quarter
        # of a 0.4 s offline run on an H200 host); EngineCore.shutdown gives them back
        freeze_startup_heap()

    # the core's state, for callers that inspect it (tests, benchmarks, metrics)
    config = property(lambda self: self.core.config)
    model_config = property(lambda self: self.core.model_config)
    max_model_len = property(lambda self: self.core.max_model_len)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    pool = property(lambda self: self.core.pool)
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.executor.runner)  # None with tensor parallelism
    memory = property(lambda self: self.core.memory)
    stats = property(lambda self: self.core.stats)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prompt_text: str | None = None, cache_salt: str | None = None) -> None:
        params = params or SamplingParams()
        if self.tokenizer is None and (isinstance(prompt, str) or params.stop_strings):
            what = "a text prompt" if isinstance(prompt, str) else "stop strings"
            raise InvalidRequestError(f"{what} needs a tokenizer, and this engine has none "
                                      "(skip_tokenizer_init): give prompt token ids and stop_token_ids")
        if isinstance(prompt, str):
            prompt_text, prompt = prompt, encode_prompt(self.tokenizer, prompt, self.max_model_len)
        # the core checks and converts the ids (once: a 1,024-id prompt costs ~15 us a pass)
        token_ids = self.core.add_request(request_id, prompt, params, cache_salt)
        self.processor.add_request(request_id, prompt_text, token_ids, params)

    def abort_request(self, request_id: str) -> None:
        self.core.abort(request_id)
        self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step; the outputs of the requests that changed (``final_only``: of
        those that finished)."""
        outputs, stopped = self.processor.process(self.core.step(), final_only)
        for request_id, index in stopped:
            self.core.abort(request_id, index)
        return outputs

    def run(self, progress=None) -> dict[str, RequestOutput]:
        """Step until every request is done; returns the final output of each."""
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for output in self.step(final_only=True):
                if output.finished:
                    done[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        return done
