"""Tensor parallelism for the shared model code: which slice of each weight a rank holds, and
the two collectives that put the slices back together.

Megatron's layout: q/k/v and gate/up are split by output rows (column-parallel: each rank
computes its own heads and its own slice of the MLP), o and down by input columns (row-parallel:
each rank produces a partial sum, ``reduce`` adds them). The embedding and the LM head are split
over the vocabulary (padded to a multiple of the world size): a rank looks up only the tokens in
its slice and computes only its slice of the logits, and ``gather`` joins the slices. Slicing
happens on the host, at load time, so each rank uploads only its own part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_core.interfaces import QuantizedWeight
from fd_core.quantization.host import HostWeight, take

from fd_core.errors import ConfigError
from fd_core.interfaces import Communicator
from fd_core.models.config import ModelConfig
from fd_core.models.moe import MoeSpec


@dataclass(frozen=True)
class TensorParallel:
    """``expert_parallel`` (--enable-expert-parallel): a mixture of experts' routed experts are
    dealt out whole, ``E / world_size`` to each rank, instead of each rank holding a slice of
    every expert. Attention stays tensor-parallel, so every rank has every token after it: a
    rank runs its own experts on the tokens that chose them (``moe``'s ``expert_offset``) and
    the ranks' partial sums are added like a row-parallel matmul's. (An all-to-all dispatch
    pays off only when ranks hold different tokens: data-parallel attention, which fd has not.)"""

    rank: int = 0
    world_size: int = 1
    comm: Communicator | None = None
    expert_parallel: bool = False

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def check(self, c: ModelConfig, moe: MoeSpec | None = None) -> None:
        """Refuse, before any weight is read, a model that does not split over this many ranks."""
        parts = [("attention heads", c.num_attention_heads), ("key-value heads", c.num_key_value_heads),
                 ("MLP width", c.intermediate_size)]
        if self.expert_parallel and moe is None:
            raise ConfigError(f"--enable-expert-parallel: {c.architecture} has no mixture-of-experts layers")
        if moe is not None:
            if self.expert_parallel:
                if moe.num_experts % self.world_size:
                    raise ConfigError(f"--enable-expert-parallel: the model's {moe.num_experts} experts per layer "
                                      f"do not divide over --tensor-parallel-size {self.world_size}")
            else:
                parts.append(("experts' width (moe_intermediate_size)", moe.intermediate_size))
            parts.append(("shared experts' width", moe.shared_intermediate_size))
        for what, count in parts:
            if count % self.world_size:
                raise ConfigError(
                    f"--tensor-parallel-size {self.world_size} must divide the model's {what} ({count})"
                )

    def local_experts(self, num_experts: int) -> range:
        """The routed experts this rank holds: all of them unless experts are dealt out."""
        if not (self.expert_parallel and self.enabled):
            return range(num_experts)
        count = num_experts // self.world_size
        return range(self.rank * count, (self.rank + 1) * count)

    def part(self, array: HostWeight, axis: int = 0, name: str = "") -> HostWeight:
        """This rank's equal slice of ``array`` along ``axis`` (a quantized weight's scales and
        zeros with it)."""
        size = array.shape[axis] // self.world_size
        if isinstance(array, QuantizedWeight):
            return take(array, axis, self.rank * size, (self.rank + 1) * size, name) if self.enabled else array
        index = [slice(None)] * array.ndim
        index[axis] = slice(self.rank * size, (self.rank + 1) * size)
        return array[tuple(index)]

    # -- vocabulary ------------------------------------------------------------------------

    def vocab_slice(self, vocab_size: int) -> tuple[int, int]:
        """``(start, size)`` of this rank's vocabulary slice (the last may cover padding)."""
        size = -(-vocab_size // self.world_size)
        return self.rank * size, size

    def vocab_part(self, weight: np.ndarray, lookup_row: bool) -> np.ndarray:
        """This rank's rows of a ``[V, H]`` embedding or LM head. ``lookup_row`` appends a zero
        row: tokens outside the slice are looked up there, so they add nothing to ``reduce``."""
        if not self.enabled:
            return weight
        start, size = self.vocab_slice(weight.shape[0])
        part = np.zeros((size + int(lookup_row), weight.shape[1]), dtype=weight.dtype)
        rows = weight[start:start + size]
        part[: rows.shape[0]] = rows
        return part

    def local_token_ids(self, ids: np.ndarray, vocab_size: int) -> np.ndarray:
        """Token ids as rows of this rank's embedding slice; others point at its zero row."""
        if not self.enabled:
            return ids
        start, size = self.vocab_slice(vocab_size)
        local = ids - start
        local[(local < 0) | (local >= size)] = size
        return local

    # -- collectives -----------------------------------------------------------------------

    def reduce(self, x: Any) -> Any:
        """Sum of the ranks' partial results (after a row-parallel matmul)."""
        return self.comm.all_reduce(x) if self.enabled else x

    def gather(self, x: Any) -> Any:
        """The ranks' vocabulary slices side by side (logits)."""
        return self.comm.all_gather(x, axis=-1) if self.enabled else x
