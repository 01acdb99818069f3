"""Contract version and the compatibility rule between a backend and the core."""

API_VERSION = "1.22.0"
# 1.1: Capabilities.kv_swap with Memory.allocate_host_kv_cache / swap_blocks (preemption by
#      swap); Platform.default_max_num_batched_tokens (optional); Platform.communicator(...,
#      rendezvous) for tensor parallelism
# 1.2: Platform.runtimes / Platform.with_runtime (optional: a platform on several runtimes,
#      chosen with --runtime); OpRegistry.register(..., runtime=...) ties an implementation to
#      one runtime's tensors; OpRegistry.use_reference(device_type, runtime) adopts a runtime's
#      reference ops as the backend's own. And sample's noise is counter-based
#      (fd_core.testing.spec.sampling_noise: a 32-bit integer hash of seed, step and token id,
#      computable element-wise on a device) instead of numpy.random.default_rng([seed, step]);
#      a seeded request draws other tokens than under 1.1. Memory.profile (where
#      Capabilities.memory_profiling is declared: --gpu-memory-utilization);
#      ModelRunnerHooks.wrap_forward(forward, limits) and the replacement's warm_up
# 1.3: optional ops (OpSpec.optional); the optional sample_async op returning a PendingSample
#      (feed / result), with which the engine schedules asynchronously (--async-scheduling)
# 1.4: Platform.default_long_prefill_token_threshold (optional): the platform's proposal for
#      --long-prefill-token-threshold; a supports predicate may carry why(**context), the
#      sentence fd doctor shows when it declines
# 1.5: QuantizedWeight.zeros (asymmetric groups: GGUF Q4_1/Q4_K minimums) and .layout, the
#      block_wise_fp8 method; linear selected per quantization method; the optional
#      pack_linear op (a backend's packed weight form, made once at load)
# 1.6: quantized KV caches (int8 / fp8_e4m3 in kv_cache_dtypes); block_wise_fp8 linear may
#      round its activations to FP8 (W8A8)
# 1.7: moe's expert_offset (--enable-expert-parallel: a rank's experts are a contiguous share)
# 1.8: the optional pack_experts op, paired with moe by name (a backend's stacked expert form,
#      made once at load)
# 1.9: Platform.default_dtype (optional): what --dtype auto (now the default) means there
# 1.10: SamplingBatch.allowed_token_bitmask: sample and sample_async leave out the tokens a
#      row's packed bitmask clears (structured output)
# 1.11: SamplingBatch.logit_bias: sample and sample_async add each row's per-token biases to its
#      logits before the penalties (OpenAI's logit_bias); the optional token_logprobs op (the
#      logprobs of given tokens, for prompt_logprobs)
# 1.12: the optional deferred_bitmask op: sample_async may take a bitmask the host fills after
#      the sample is queued (the device waits for DeferredBitmask.ready()); PendingSample.result
#      may be called more than once, from any thread
# 1.13: RunnerLimits.num_speculative_tokens (speculative decoding: decode rows of up to 1 + k
#      tokens), and a wrap_forward replacement's optional uniform_drafts (the engine then pads
#      every decoding sequence's drafts to k, so verification steps have one shape per batch size)
# 1.14: the fd_kv_transfers hook and fd_core.interfaces.kv_transfer.KVTransfer: KV-cache
#      connectors for prefill/decode disaggregation (--cache-transfer-protocol)
# 1.15: Memory.to_numpy_bits / from_numpy_bits (optional): tensors as their stored bits, so a
#      bfloat16 KV cache travels between prefill and decode instances at its own size
# 1.16: device KV-cache connectors (optional KVTransfer.device, the platform whose tensors
#      they move): the engine hands them a device copy of a request's blocks, no host staging
# 1.17: embedding gathers the rows of an int64 table too (the kit checks it): with tensor
#      parallelism the model maps token ids to a rank's embedding rows on the device, so a
#      step's input ids can come from the previous step's sample on every rank
# 1.18: a wrap_forward replacement's optional attach_head / with_head: a decode step's forward
#      and the model's head (the logits of every row) in one call, e.g. one captured graph
# 1.19: the optional fused op rotary_attention (rotary then attention in one call, so a backend
#      may rotate q and k in the kernel that writes the KV cache), used where the package that
#      made it also serves the parts chosen (FUSED_OPS). A second fused op added in 1.19,
#      silu_and_mul_linear (a dense MLP's activation and down projection), was withdrawn within
#      1.19: on an H200 (2026-11-28) cuda's fusion made a batch-1 decode step of ERNIE-4.5-0.3B
#      slower (GPU time 544 vs 535 us with silu_and_mul then linear), every program of the fused
#      kernel re-reading and re-activating the whole gate/up row
# 1.20: a wrap_forward replacement's optional attach_sampler / with_sample: a decode step's
#      forward, head and draw of its tokens in one call (a graph holding the sampling kernel
#      too), with the op table's sample_async attached so that a replacement draws only with
#      the sampler the runner chose
# 1.21: a drawing replacement's optional advance_sample(batch): the decode step after the one it
#      drew last (a round of --num-scheduler-steps), its inputs made where that draw is (the
#      same sequences one position further, each fed its drawn token), so the host builds and
#      uploads nothing for a round's later steps; SamplingBatch.needs_suppression, beside
#      needs_penalties (whether a row suppresses tokens), which cuda's sampler reads
# 1.22: Capabilities.quantized_lm_head (optional, empty by default): the quantization methods
#      whose linear multiplies the dequantized weight exactly with unrounded activations, so a
#      checkpoint's quantized LM head (a GGUF's Q8_0 token embedding) stays quantized


def _parse(version: str) -> tuple[int, int, int]:
    parts = str(version).strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a semantic version: {version!r}")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return nums[0], nums[1], nums[2]


def at_least(version: str, minimum: str) -> bool:
    """Whether contract ``version`` includes what ``minimum`` added."""
    return _parse(version) >= _parse(minimum)


def is_compatible(backend_version: str, core_version: str = API_VERSION) -> tuple[bool, str]:
    """Whether a backend written against ``backend_version`` may load into this core.

    Same major, and the backend's minor no newer than the core's: a minor release only adds to
    the contract, so an older backend still finds everything it uses. Returns ``(ok, reason)``.
    """
    try:
        b_major, b_minor, _ = _parse(backend_version)
    except ValueError as exc:
        return False, str(exc)
    c_major, c_minor, _ = _parse(core_version)
    if b_major != c_major:
        return False, (
            f"written for fd plugin API {backend_version}, this fd-core speaks {core_version} "
            f"(major versions differ)"
        )
    if b_minor > c_minor:
        return False, (
            f"needs fd plugin API {backend_version}, this fd-core only provides {core_version}; "
            f"upgrade fd-core"
        )
    return True, ""
