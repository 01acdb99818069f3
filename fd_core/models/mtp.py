"""Multi-token prediction (MTP): the extra layer of an ERNIE 4.5 checkpoint (DeepSeek-V3's
design) that predicts the token after next, the ``mtp`` speculative proposer's model.

At position ``p`` it reads the target's final hidden state ``h_p`` and the embedding of the
token at ``p + 1``: ``x = W_e · norm_e(embed(t[p+1])) + W_h · norm_h(h_p)`` (one ``[H, 2H]``
projection over the two halves, applied as two linears: the op contract has no concatenation),
then one decoder layer of the target's shape, then the target's final norm and LM head, which
it shares, as it shares the embedding. Its hidden state at ``p`` stands in for ``h_{p+1}`` when
it predicts one more token ahead. Under tensor parallelism its layer is split like the
target's and the projection is whole on every rank (the residual stream is whole there).

Weights as in ERNIE 4.5's Hugging Face checkpoints (FastDeploy's and vLLM's names):
``model.mtp_emb_norm.0.weight``, ``model.mtp_hidden_norm.0.weight``,
``model.mtp_linear_proj.0.weight`` ``[H, 2H]`` (embedding half first) and the decoder layer
under ``model.mtp_block.0.``, its MLP dense.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from fd_core.interfaces import AttentionMetadata, QuantizedWeight
from fd_core.models.decoder import DecoderForCausalLM, collect_weights
from fd_core.quantization.host import HostWeight, as_float

Tensor = Any
PREFIX = "model.mtp_"
BLOCK = "model.mtp_block.0."


def mtp_weight_shapes(target: DecoderForCausalLM) -> dict[str, tuple[int, ...]]:
    c = target.config
    h = c.hidden_size
    shapes = {"model.mtp_emb_norm.0.weight": (h,), "model.mtp_hidden_norm.0.weight": (h,),
              "model.mtp_linear_proj.0.weight": (h, 2 * h)}
    shapes.update(target.traits.layer_shapes(c, BLOCK))
    return shapes


class MtpLayer:
    """The MTP layer over a loaded target model (``load_weights``, then ``forward``)."""

    reads_target_hidden = True

    def __init__(self, target: DecoderForCausalLM) -> None:
        self.target = target
        self.config = replace(target.config, num_hidden_layers=1)  # its KV cache: one layer
        self.num_kv_heads, self.head_dim = target.num_kv_heads, target.head_dim

    def load_weights(self, weights: Iterable[tuple[str, HostWeight]],
                     quantize: Callable[[str, HostWeight], QuantizedWeight] | None = None) -> None:
        """``weights``: the checkpoint's ``model.mtp_*`` tensors (others are ignored); the
        block's linears quantized as the target's (the projection, ``mtp_linear_proj.0``, is
        not a ``*_proj.weight``)."""
        host = collect_weights(weights, mtp_weight_shapes(self.target), quantize)
        t, h = self.target, self.target.config.hidden_size
        up = t.to_device
        self.emb_norm = up(host.pop("model.mtp_emb_norm.0.weight"), norm=True)
        self.hidden_norm = up(host.pop("model.mtp_hidden_norm.0.weight"), norm=True)
        proj = as_float(host.pop("model.mtp_linear_proj.0.weight"))
        self.proj_emb, self.proj_hidden = up(proj[:, :h].copy()), up(proj[:, h:].copy())
        self.layer = t.upload_layer(BLOCK, host)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                meta: AttentionMetadata, previous: Tensor) -> Tensor:
        """The MTP hidden states: ``input_ids`` are the tokens one position ahead of
        ``positions``, ``previous`` the target's (or this layer's) hidden states at them."""
        t = self.target
        ops, eps = t.ops, t.config.rms_norm_eps
        x = (ops.linear(ops.rms_norm(t.embed_tokens(input_ids), self.emb_norm, eps), self.proj_emb)
             + ops.linear(ops.rms_norm(previous, self.hidden_norm, eps), self.proj_hidden))
        return t.run_layers(x, [self.layer], positions, kv_caches, meta)

    def compute_logits(self, hidden: Tensor, row_indices: Tensor | None) -> Tensor:
        return self.target.compute_logits(hidden, row_indices)

    @property
    def tp(self):
        return self.target.tp
