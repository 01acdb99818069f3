"""Mixture-of-experts layers of the shared decoder: which layers are sparse, how their router
picks experts, and the names and shapes of their weights.

One description (``MoeSpec``) covers the two families fd serves:

- Qwen3-MoE (``Qwen3MoeForCausalLM``): softmax router, top-k, renormalised only with
  ``norm_topk_prob``, no shared expert; a layer is sparse unless listed in ``mlp_only_layers``
  and when ``(i + 1) % decoder_sparse_step == 0``.
- ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``): softmax router whose top-k choice adds the
  checkpoint's ``e_score_correction_bias`` (the weights stay the plain probabilities), always
  renormalised, ``moe_num_shared_experts`` shared experts fused into one MLP of
  ``moe_intermediate_size * moe_num_shared_experts`` added to every token; the sparse layers
  are ``moe_layer_start_index..moe_layer_end_index`` every ``moe_layer_interval``.

The routed experts run through the ``moe`` op (a backend may fuse them); the shared expert is
an ordinary MLP beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fd_core.errors import CheckpointError
from fd_core.models.config import ModelConfig


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each routed expert
    shared_intermediate_size: int  # of the fused shared experts; 0: none
    renormalize: bool
    correction_bias: bool  # the router's choice adds a per-expert bias from the checkpoint
    sparse_layers: frozenset[int]
    scoring: str = "softmax"

    def weight_shapes(self, prefix: str, hidden: int, experts: range | None = None) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of the weights of the sparse layer at ``prefix`` (``model.layers.3.``);
        of the routed experts, only ``experts`` (all by default: a rank's share under expert
        parallelism)."""
        inter = self.intermediate_size
        p = prefix + "mlp."
        shapes: dict[str, tuple[int, ...]] = {p + "gate.weight": (self.num_experts, hidden)}
        for e in range(self.num_experts) if experts is None else experts:
            shapes[f"{p}experts.{e}.gate_proj.weight"] = (inter, hidden)
            shapes[f"{p}experts.{e}.up_proj.weight"] = (inter, hidden)
            shapes[f"{p}experts.{e}.down_proj.weight"] = (hidden, inter)
        if self.correction_bias:
            shapes[p + "moe_statics.e_score_correction_bias"] = (1, self.num_experts)
        if self.shared_intermediate_size:
            shared = self.shared_intermediate_size
            shapes[p + "shared_experts.gate_proj.weight"] = (shared, hidden)
            shapes[p + "shared_experts.up_proj.weight"] = (shared, hidden)
            shapes[p + "shared_experts.down_proj.weight"] = (hidden, shared)
        return shapes


def _int(raw: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present in the config (transformers renamed some between versions)."""
    for key in keys:
        if raw.get(key) is not None:
            return raw[key]
    if default is None:
        raise CheckpointError(f"the MoE config lacks {' / '.join(keys)}")
    return default


def moe_spec(family: str, config: ModelConfig) -> MoeSpec:
    """The MoE layers of a ``family`` (``"qwen3"`` or ``"ernie"``) checkpoint's config."""
    raw, layers = config.raw, config.num_hidden_layers
    try:
        if family == "qwen3":
            experts = int(_int(raw, "num_experts", "num_local_experts"))
            step = int(_int(raw, "decoder_sparse_step", default=1))
            dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
            sparse = {i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0}
            spec = MoeSpec(experts, int(_int(raw, "num_experts_per_tok")), int(_int(raw, "moe_intermediate_size")),
                           0, bool(raw.get("norm_topk_prob", False)), False, frozenset(sparse))
        elif family == "ernie":
            experts = int(_int(raw, "moe_num_experts", "num_experts"))
            start = int(_int(raw, "moe_layer_start_index", default=1))
            end = int(_int(raw, "moe_layer_end_index", default=-1))
            end = layers - 1 if end == -1 else end
            interval = int(_int(raw, "moe_layer_interval", default=1))
            sparse = {i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end}
            inter = int(_int(raw, "moe_intermediate_size"))
            shared = int(_int(raw, "moe_num_shared_experts", default=0))
            spec = MoeSpec(experts, int(_int(raw, "moe_k", "num_experts_per_tok")), inter, inter * shared, True,
                           True, frozenset(sparse))
        else:
            raise ValueError(f"unknown MoE family {family!r}")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the MoE config has a malformed value: {exc}") from None
    if not 1 <= spec.top_k <= spec.num_experts:
        raise CheckpointError(f"the MoE config routes each token to {spec.top_k} of {spec.num_experts} experts")
    return spec
