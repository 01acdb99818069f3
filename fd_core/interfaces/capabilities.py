"""The immutable manifest of what a backend can do, checked before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, fields

# What Capabilities.speculative_methods may name: the proposers of fd_core/engine/speculative.
# Each runs on the shared model runner; a backend needs the attention of chunked prefill (a
# decode row of several tokens over its cached prefix) to verify their drafts.
SPECULATIVE_METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. Frozen: the engine validates its config against this once, at
    start-up, so the manifest must not change under it.

    Collections are frozensets/tuples so that the object is hashable and truly immutable.
    """

    dtypes: frozenset[str] = frozenset({"float32"})
    quantization: frozenset[str] = frozenset()  # members of QUANTIZATION_METHODS: wint8, wint4, block_wise_fp8
    kv_cache_dtypes: frozenset[str] = frozenset({"float32"})
    graph_capture: bool = False
    # the attention op reads a cached prefix for a query that starts at a block boundary
    # (the engine does the caching itself; this only says the kernel can use it)
    prefix_caching: bool = False
    # the attention op mixes prefill chunks (attending to earlier chunks) and decodes in a step
    chunked_prefill: bool = False
    # Memory.allocate_host_kv_cache / swap_blocks work: preemption by swap (--swap-space)
    kv_swap: bool = False
    # --speculative-config methods the backend runs (members of SPECULATIVE_METHODS)
    speculative_methods: frozenset[str] = frozenset()
    collective_library: str = "none"  # "none" (single process), "gloo", "nccl", "bkcl", ...
    pinned_host_memory: bool = False
    device_count: int = 1
    memory_query: bool = False  # can report free/total device memory
    # can size the KV cache from free device memory after a profiling forward
    # (--gpu-memory-utilization); without it the cache is sized by --kv-cache-memory-gb
    memory_profiling: bool = False
    # quantization methods whose linear multiplies the dequantized weight exactly, activations
    # unrounded: a checkpoint's LM head stored in one of them (a GGUF's Q8_0 token embedding)
    # stays quantized instead of widening to the model's dtype
    quantized_lm_head: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (set, list, tuple)) and f.type.startswith("frozenset"):
                object.__setattr__(self, f.name, frozenset(value))

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = sorted(value) if isinstance(value, frozenset) else value
        return out

    def unsupported(self, **wanted: object) -> list[str]:
        """Names of the wanted features this manifest lacks, as ``"field=value"`` strings.

        ``wanted`` maps a field name to the value the config asks for: a member for set-valued
        fields, ``True`` for boolean ones, a number for ``device_count`` (the minimum needed).
        """
        missing = []
        for name, value in wanted.items():
            have = getattr(self, name)
            if isinstance(have, frozenset):
                ok = value in have
            elif isinstance(have, bool):
                ok = have or not value
            elif isinstance(have, int):
                ok = have >= int(value)  # type: ignore[arg-type]
            else:
                ok = have == value
            if not ok:
                missing.append(f"{name}={value}")
        return missing
