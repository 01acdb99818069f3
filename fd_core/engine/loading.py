"""Building one rank's ModelRunner: device memory, op table, model, weights. Shared by the
engine core (rank 0) and tensor-parallel workers, so every rank is built the same way."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fd_core.engine.config import EngineConfig, GiB
from fd_core.engine.model_runner import ModelRunner
from fd_core.engine.speculative.config import FLAG as SPECULATIVE_FLAG
from fd_core.errors import ConfigError
from fd_core.interfaces import Communicator, Memory, Platform, RunnerLimits
from fd_core.phases import phase, progress
from fd_core.plugins.ops import op_context
from fd_core.models.mtp import PREFIX as MTP_PREFIX
from fd_core.models.mtp import MtpLayer
from fd_core.quantization.quantize import LoadQuantization


def open_checkpoint(config: EngineConfig) -> Any:
    """``config.model`` as ``--load-format`` says: the checkpoint, or (dummy) its folder's config
    and tokenizer with random weights, the linears already in ``--quantization``'s form."""
    from fd_core.loader import load_checkpoint, resolve_model
    from fd_core.loader.chat_template import read_chat_template
    from fd_core.loader.dummy import load_dummy
    from fd_core.loader.formats import load_tokenizer

    path = resolve_model(config.model)
    # the checkpoint's own tokenizer, unless there is to be none or --tokenizer replaces it
    own = not config.skip_tokenizer_init and config.tokenizer is None
    if config.load_format == "dummy":
        method = None if config.quantization is None else (config.quantization, config.quantization_group_size)
        checkpoint = load_dummy(path, method, tokenizer=own)
    else:
        checkpoint = load_checkpoint(path, tokenizer=own)
    if config.tokenizer is not None:
        checkpoint.tokenizer = load_tokenizer(resolve_model(config.tokenizer))
    if config.chat_template is not None:  # a file or the template; validate() has checked it
        checkpoint.tokenizer.chat_template = read_chat_template(config.chat_template)
    return checkpoint


def describe(checkpoint: Any) -> str:
    """A checkpoint in a few words, for the start-up log."""
    return f"{checkpoint.format}, {checkpoint.config.architecture}, {checkpoint.num_tensors} tensors"


def load_runner(config: EngineConfig, platform: Platform, registry: Any, rank: int = 0, world_size: int = 1,
                comm: Communicator | None = None, checkpoint: Any = None, proposer_source: Any = None) -> ModelRunner:
    """``config.max_model_len`` must be resolved. ``checkpoint`` is loaded from ``config.model``
    when not given, and the speculative proposer's (``open_proposer``) likewise."""
    from fd_core.models import TensorParallel, build_model

    if checkpoint is None:
        with phase("reading the checkpoint") as step:
            checkpoint = open_checkpoint(config)
            step.detail = describe(checkpoint)
    model_config = checkpoint.config
    with phase("setting up the device") as step:  # imports the tensor library, probes kernels
        memory = platform.memory(rank % max(1, platform.device_count()))
        # each quantization method the backend declares gets its own linear; weights of other
        # methods are dequantized at load (DecoderForCausalLM.load_weights)
        ops = registry.op_table(platform, context=op_context(config.dtype, model_config.head_dim),
                                pins=config.op_pins, methods=platform.capabilities().quantization)
        step.detail = f"{getattr(memory, 'device', platform.name)}, runtime {platform.runtime}"
    tp = TensorParallel(rank, world_size, comm, expert_parallel=config.enable_expert_parallel)
    why = ops.lacks("embedding", "1.17") if tp.enabled else ""
    if why:  # DecoderForCausalLM.embed_tokens maps token ids through an int64 table
        raise ConfigError(f"--tensor-parallel-size {world_size}: on the {platform.name} backend {why}, which "
                          f"added int64 tables to it (token ids to a rank's embedding rows)")
    quantize = None
    if config.quantization is not None:  # validate() filled in the method's group size
        quantize = LoadQuantization(config.quantization, config.quantization_group_size)
    with phase("loading weights") as step:
        model = build_model(model_config, ops, memory, config.max_model_len, config.dtype, tp)
        model.quantized_lm_head = platform.capabilities().quantized_lm_head
        skip = model.other_ranks_weights()
        count = sum(name not in skip for name in checkpoint.weight_names())
        model.load_weights(progress(checkpoint.weights(skip=skip), count, "loading weights", "tensor"), quantize)
        size = model.weight_bytes()
        size_text = f"{size / GiB:.2f} GiB" if size >= GiB else f"{size / (1 << 20):.1f} MiB"
        step.detail = (f"{count} tensors, {size_text} on the device"
                       + (f" (rank {rank} of {world_size})" if world_size > 1 else ""))
    if quantize is not None:
        quantize.report()
    source = proposer_source or open_proposer(config, checkpoint)
    proposer = None if source is None else load_proposer_model(config, model, source, ops, memory, tp, quantize)
    spec = config.speculative_config
    limits = RunnerLimits(config.max_num_seqs, config.max_model_len, config.max_num_batched_tokens,
                          config.block_size, spec.num_speculative_tokens if spec is not None else 0)
    return ModelRunner(model, ops, memory, config.block_size, platform.runner_hooks(), limits,
                       enforce_eager=config.enforce_eager, proposer=proposer)


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The engine config that opens ``--speculative-config``'s draft model (or the folder holding
    MTP weights): its own checkpoint and format, no tokenizer, no load-time quantization."""
    return replace(config, model=config.speculative_config.model, tokenizer=None, chat_template=None,
                   skip_tokenizer_init=True, quantization=None, quantization_group_size=None)


def open_proposer(config: EngineConfig, target: Any) -> Any:
    """The checkpoint the speculative proposer's model is read from — the draft model's, or for
    ``mtp`` the folder ``model`` names, else the target's own (``target``) — checked before
    anything loads: a draft model whose vocabulary is not the target's, or ``mtp`` where there
    are no MTP weights, stop start-up naming the flag. None for a proposer without a model."""
    spec = config.speculative_config
    if spec is None or spec.method == "ngram":
        return None
    source = open_checkpoint(draft_engine_config(config)) if spec.model else target
    if spec.method == "mtp" and not source.extra_names(MTP_PREFIX):
        raise ConfigError(f"{SPECULATIVE_FLAG}: method 'mtp' needs the MTP layer's weights ({MTP_PREFIX}*), "
                          f"and {source.path} has none")
    vocab, own = source.config.vocab_size, target.config.vocab_size
    if spec.method == "draft_model" and vocab != own:
        raise ConfigError(f"{SPECULATIVE_FLAG}: the draft model {spec.model} has a vocabulary of {vocab} "
                          f"tokens and the target {own}; a draft model must share the target's vocabulary")
    return source


def proposer_cache_shape(config: EngineConfig, target: Any, source: Any) -> tuple[int, int, int] | None:
    """The KV-cache layers, key-value heads and head size of the proposer's model read from
    ``source`` (``open_proposer``; None: no model): an MTP layer is one of the target's layers."""
    if source is None:
        return None
    c = target.config if config.speculative_config.method == "mtp" else source.config
    layers = 1 if config.speculative_config.method == "mtp" else c.num_hidden_layers
    return layers, c.num_key_value_heads, c.head_dim


def load_proposer_model(config: EngineConfig, target: Any, source: Any, ops: Any, memory: Memory,
                        tp: Any, quantize: LoadQuantization | None = None) -> Any:
    """The proposer's model beside the loaded ``target``, read from ``source``
    (``open_proposer``): the draft model on the same ops, memory and ranks, or the MTP layer."""
    from fd_core.models import build_model

    spec = config.speculative_config
    with phase(f"loading the {spec.method} proposer") as step:
        if spec.method == "mtp":
            model = MtpLayer(target)
            model.load_weights(source.extra_weights(MTP_PREFIX), quantize)
        else:
            model = build_model(source.config, ops, memory, config.max_model_len, config.dtype, tp)
            model.load_weights(source.weights())
        step.detail = str(source.path)
    return model
