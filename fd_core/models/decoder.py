"""The decoder-only transformer shared by Llama, Qwen3 and ERNIE 4.5, dense or with
mixture-of-experts layers (Qwen3-MoE, ERNIE 4.5 MoE: ``models/moe.py``).

Written once for every chip: tensors are touched only through the op table (``self.ops``) and
the documented subset ``+``, ``*``, slicing, ``.reshape``, ``.shape``, ``.dtype``. The variants
differ in data, not in code paths per chip: rotary style, per-head q/k norm, biases and tied
embeddings are properties of the checkpoint.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from fd_core.errors import CheckpointError
from fd_core.interfaces import AttentionMetadata, Memory, QuantizedWeight
from fd_core.models.config import ModelConfig
from fd_core.models.moe import MoeSpec, moe_spec
from fd_core.models.parallel import TensorParallel
from fd_core.models.rope import cos_sin_table
from fd_core.quantization.host import (
    HostWeight,
    as_float,
    concat_rows,
    upload_quantized,
)

log = logging.getLogger("fd.model")

Tensor = Any


@dataclass(frozen=True)
class DecoderTraits:
    """What distinguishes one architecture of this family from another."""

    rope_style: str = "neox"  # "neox" (rotate halves) or "interleaved" (rotate pairs)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    moe: str | None = None  # the MoE family ("qwen3", "ernie": models/moe.py); None: dense

    def moe_spec(self, c: ModelConfig) -> MoeSpec | None:
        return None if self.moe is None else moe_spec(self.moe, c)

    def layer_shapes(self, c: ModelConfig, p: str, moe: MoeSpec | None = None,
                     experts: range | None = None) -> dict[str, tuple[int, ...]]:
        """One decoder layer's weights under prefix ``p``: a sparse layer's experts where
        ``moe`` is given, else the dense MLP."""
        h, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
        q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {}
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if c.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if c.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if self.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if moe is not None:
            shapes.update(moe.weight_shapes(p, h, experts))
        else:
            for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                shapes[f"{p}mlp.{proj}_proj.weight"] = shape
                if c.mlp_bias:
                    shapes[f"{p}mlp.{proj}_proj.bias"] = (shape[0],)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        return shapes

    def weight_shapes(self, c: ModelConfig, experts: range | None = None) -> dict[str, tuple[int, ...]]:
        """HF name -> ``[out, in]`` shape of every weight; biases where the config has them.
        ``experts``: the routed experts to include (all by default)."""
        h = c.hidden_size
        moe = self.moe_spec(c)
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
        for i in range(c.num_hidden_layers):
            sparse = moe is not None and i in moe.sparse_layers
            shapes.update(self.layer_shapes(c, f"model.layers.{i}.", moe if sparse else None, experts))
        shapes["model.norm.weight"] = (h,)
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, h)
        return shapes


@dataclass
class Experts:
    """A sparse layer's weights: the router (float32), the routed experts' fused gate/up and
    down (lists, one entry per expert, or what the backend's ``pack_experts`` made of them),
    the correction bias the router's choice adds (ERNIE), and the shared expert (ERNIE)."""

    router: Tensor
    gate_up: Any
    down: Any
    count: int  # this rank's routed experts
    first: int  # the id of gate_up[0]: with experts dealt out over ranks, this rank's first
    correction_bias: Tensor | None
    shared_gate_up: Tensor | None
    shared_down: Tensor | None


class Layer:
    """One decoder layer's weights, fused for fewer op calls: q/k/v into one matrix and
    gate/up into another (the split is a slice of the output). A sparse layer has ``experts``
    instead of the dense MLP."""

    qkv: Tensor
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor | None
    gate_up_bias: Tensor | None
    down: Tensor | None
    down_bias: Tensor | None
    experts: Experts | None
    input_norm: Tensor
    post_norm: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None


def checked_weights(weights: Iterable[tuple[str, HostWeight]], expected: dict[str, tuple[int, ...]],
                    quantize: Callable[[str, HostWeight], QuantizedWeight] | None = None,
                    ) -> Iterator[tuple[str, HostWeight]]:
    """The ``expected`` weights (HF name -> shape) of a stream, checked, each linear
    (``*_proj.weight``) quantized as it arrives; others are skipped (e.g. rotary_emb.inv_freq
    buffers: derived, not loaded). A wrong shape, or at the end a missing tensor, is a
    CheckpointError naming it."""
    seen: set[str] = set()
    for name, array in weights:
        want = expected.get(name)
        if want is None:
            continue
        if tuple(array.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(array.shape)}, expected {want}")
        if quantize is not None and name.endswith("_proj.weight"):  # the decoder's linears
            array = quantize(name, array)
        seen.add(name)
        yield name, array
    missing = [n for n in expected if n not in seen]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"checkpoint lacks tensors {missing[:3]}{more}")


def collect_weights(weights: Iterable[tuple[str, HostWeight]], expected: dict[str, tuple[int, ...]],
                    quantize: Callable[[str, HostWeight], QuantizedWeight] | None = None) -> dict[str, HostWeight]:
    """``checked_weights`` as one dict (a part small enough to hold whole: the MTP layer)."""
    return dict(checked_weights(weights, expected, quantize))


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _layer_of(name: str) -> int:
    """The decoder layer a weight belongs to; -1 for the embedding, the final norm, the head."""
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


class DecoderForCausalLM:
    """A causal LM over the paged KV cache. ``forward`` returns hidden states of every token of
    the step; ``compute_logits`` projects only the rows that will be sampled.

    Under tensor parallelism (``tp``) each rank holds its slice of the heads, of the MLP and of
    the vocabulary (``models/parallel.py``), and its KV cache holds only its key-value heads."""

    def __init__(self, config: ModelConfig, traits: DecoderTraits, ops: Any, memory: Memory,
                 max_model_len: int, dtype: str = "float32", tp: TensorParallel | None = None) -> None:
        self.config = config
        self.traits = traits
        self.ops = ops
        self.memory = memory
        self.dtype = dtype
        self.tp = tp or TensorParallel()
        self.moe = traits.moe_spec(config)
        self.tp.check(config, self.moe)
        c = config
        self.num_heads = c.num_attention_heads // self.tp.world_size
        self.num_kv_heads = c.num_key_value_heads // self.tp.world_size
        self.head_dim = c.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        partial = float(c.raw.get("partial_rotary_factor", 1.0))
        self.rotary_dim = int(self.head_dim * partial)
        self.cos_sin = memory.from_numpy(
            cos_sin_table(self.rotary_dim, max_model_len, c.rope_theta, c.rope_scaling), "float32"
        )
        self.layers: list[Layer] = []
        self.embed: Tensor = None
        self.lm_head: Tensor = None
        self.norm: Tensor = None
        self.vocab_rows: Tensor | None = None  # int64 [V, 1]: a token id's row in this rank's embedding
        # methods whose quantized LM head the backend multiplies exactly (Capabilities.quantized_lm_head)
        self.quantized_lm_head: frozenset[str] = frozenset()
        self._dequantized: Counter[str] = Counter()  # quantized weights load_weights dequantized, by method
        self._unfused: Counter[str] = Counter()  # quantized parts fused as floats, by method

    # -- weights ---------------------------------------------------------------------------

    def other_ranks_weights(self) -> set[str]:
        """Checkpoint names this rank does not hold: with experts dealt out, the other ranks'
        routed experts. The loader does not read them (each rank would otherwise read the whole
        checkpoint: four times the 300B-A47B's experts on four GPUs)."""
        if self.moe is None or not (self.tp.expert_parallel and self.tp.enabled):
            return set()
        every = self.traits.weight_shapes(self.config, None)
        mine = self.traits.weight_shapes(self.config, self.tp.local_experts(self.moe.num_experts))
        return set(every) - set(mine)

    def load_weights(self, weights: Iterable[tuple[str, HostWeight]],
                     quantize: Callable[[str, HostWeight], QuantizedWeight] | None = None) -> None:
        """Consume ``(hf_name, [out, in] weight)`` pairs, check them, fuse and upload them.

        ``quantize`` (``--quantization``, a ``LoadQuantization``) is applied to each decoder
        linear as it arrives, so only one float matrix is held at a time; the embedding, the
        LM head and the norms stay in the model's dtype. A quantized weight (``QuantizedWeight``)
        stays quantized where the op table has a ``linear`` for its method (the backend declares
        it) and is dequantized here otherwise, with one log line per method."""
        # with experts dealt out, other ranks' experts are not expected (other_ranks_weights)
        mine = None if self.moe is None else self.tp.local_experts(self.moe.num_experts)
        expected = self.traits.weight_shapes(self.config, mine)
        # A layer goes to the device as soon as its last tensor arrives, so the host holds about
        # one layer, not the model: collecting the whole checkpoint first held, on each of four
        # ranks, every expert of the 300B-A47B before slicing it (~300 GB a rank: killed).
        waiting = Counter(_layer_of(name) for name in expected)
        self._dequantized.clear()
        self._unfused.clear()
        self.layers = [None] * self.config.num_hidden_layers  # type: ignore[list-item]
        host: dict[str, HostWeight] = {}
        for name, array in checked_weights(weights, expected, quantize):
            host[name] = array
            layer = _layer_of(name)
            waiting[layer] -= 1
            if waiting[layer] == 0:
                self._upload(layer, host)
        for method, count in sorted(self._dequantized.items()):
            log.info("%d %s weight(s) dequantized to %s at load: the %s backend declares no %s linear",
                     count, method, self.dtype, self.ops.device_type, method)
        for method, count in sorted(self._unfused.items()):
            log.info("%d %s weight(s) dequantized to %s at load: their rows do not fill whole blocks of "
                     "the fused q/k/v or gate/up matrix", count, method, self.dtype)

    def _upload(self, layer: int, host: dict[str, HostWeight]) -> None:
        """Decoder layer ``layer``'s weights (or with -1 the embedding, norm and head), taken out
        of ``host`` to the device."""
        if layer >= 0:
            sparse = self.moe is not None and layer in self.moe.sparse_layers
            self.layers[layer] = self.upload_layer(f"model.layers.{layer}.", host, sparse)
            return
        up, tp, c = self.to_device, self.tp, self.config
        # The embedding and the LM head stay in the model's dtype whatever the checkpoint stores
        # (as FastDeploy and vLLM keep them): a lookup gathers rows, and the logits decide every
        # token (with bfloat16 activations for the head, SmolLM2's greedy text leaves
        # transformers' at margins of 0.13 where the layers alone stay within 0.003). A backend
        # that multiplies a quantized head exactly (Capabilities.quantized_lm_head) reads the
        # stored head instead: SmolLM2's Q8_0 head is 30 MB a token against 113 MB in float32.
        stored = host.pop("model.embed_tokens.weight")
        embed = as_float(stored)
        self.embed = up(tp.vocab_part(embed, lookup_row=True))
        lm = host.pop("lm_head.weight", None)
        head = stored if lm is None else lm
        if (not tp.enabled and isinstance(head, QuantizedWeight) and head.method in self.quantized_lm_head
                and self._keeps(head)):
            self.lm_head = up(head)
        elif lm is None and not tp.enabled:
            self.lm_head = self.embed  # tied: one tensor
        else:
            self.lm_head = up(tp.vocab_part(embed if lm is None else as_float(lm), lookup_row=False))
        self.norm = up(host.pop("model.norm.weight"), norm=True)
        if tp.enabled:  # token id -> row of this rank's embedding slice (embed_tokens)
            rows = tp.local_token_ids(np.arange(c.vocab_size, dtype=np.int64), c.vocab_size)
            self.vocab_rows = self.memory.from_numpy(np.ascontiguousarray(rows[:, None]))

    def upload_layer(self, p: str, host: dict[str, HostWeight], sparse: bool = False) -> Layer:
        """The decoder layer whose weights are ``host``'s under prefix ``p`` (taken out of it),
        fused and on the device as this rank holds them."""
        up, tp, get = self.to_device, self.tp, host.pop

        def column(name: str, default: Any = ...) -> HostWeight | None:
            """This rank's output rows of a column-parallel weight or bias."""
            array = host.pop(name) if default is ... else host.pop(name, default)
            return None if array is None else tp.part(array, axis=0, name=name)

        def fused(names: list[str]) -> HostWeight:
            parts = [column(n) for n in names]
            out = concat_rows(parts)  # type: ignore[arg-type]
            if not isinstance(out, QuantizedWeight):  # e.g. fp8 parts whose rows do not fill blocks
                self._unfused.update(p.method for p in parts if isinstance(p, QuantizedWeight))
            return out

        layer = Layer()
        layer.qkv = up(fused([p + f"self_attn.{n}_proj.weight" for n in "qkv"]))
        layer.qkv_bias = self._fused_bias([column(p + f"self_attn.{n}_proj.bias", None) for n in "qkv"])
        o = p + "self_attn.o_proj.weight"
        layer.o = up(tp.part(get(o), axis=1, name=o))
        layer.o_bias = self._fused_bias([get(p + "self_attn.o_proj.bias", None)])
        layer.gate_up = layer.gate_up_bias = layer.down = layer.down_bias = layer.experts = None
        if sparse:
            layer.experts = self._experts(p + "mlp.", host, fused, column)
        else:
            layer.gate_up = up(fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]))
            layer.gate_up_bias = self._fused_bias([column(p + "mlp.gate_proj.bias", None),
                                                   column(p + "mlp.up_proj.bias", None)])
            down = p + "mlp.down_proj.weight"
            layer.down = up(tp.part(get(down), axis=1, name=down))
            layer.down_bias = self._fused_bias([get(p + "mlp.down_proj.bias", None)])
        layer.input_norm = up(get(p + "input_layernorm.weight"), norm=True)
        layer.post_norm = up(get(p + "post_attention_layernorm.weight"), norm=True)
        layer.q_norm = up(get(p + "self_attn.q_norm.weight"), norm=True) if self.traits.qk_norm else None
        layer.k_norm = up(get(p + "self_attn.k_norm.weight"), norm=True) if self.traits.qk_norm else None
        return layer

    def _experts(self, p: str, host: dict[str, HostWeight], fused: Callable, column: Callable) -> Experts:
        """A sparse layer's weights from ``host``. Under tensor parallelism each rank holds a
        slice of every expert's width (gate/up by rows, down by columns), or with expert
        parallelism its share of the experts whole; either way the ``moe`` op's output is a
        partial sum that the ranks add, as a dense MLP's is."""
        up, tp, spec = self.to_device, self.tp, self.moe
        assert spec is not None

        def down(name: str, pack: bool = True) -> Tensor:
            return up(tp.part(host.pop(name), axis=1, name=name), pack=pack)

        mine = tp.local_experts(spec.num_experts)
        whole = len(mine) < spec.num_experts  # dealt out whole: no slicing by width

        def expert(e: int) -> tuple[Tensor, Tensor]:
            # quantized experts stay in the canonical form: the moe op reads them, and a
            # backend's packed form is its linear's
            names = [f"{p}experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down")]
            if whole:
                return (up(concat_rows([host.pop(names[0]), host.pop(names[1])]), pack=False),
                        up(host.pop(names[2]), pack=False))
            return up(fused(names[:2]), pack=False), down(names[2], pack=False)

        experts = [expert(e) for e in mine]
        pack = getattr(self.ops, "pack_experts", None)
        routed = [g for g, _ in experts], [d for _, d in experts]
        if pack is not None:
            del experts  # the lists alone hold the canonical forms while the backend packs them
            routed = pack(*routed)
        bias = host.pop(p + "moe_statics.e_score_correction_bias", None)
        shared = spec.shared_intermediate_size > 0
        return Experts(
            router=up(host.pop(p + "gate.weight"), norm=True),  # float32, as the reference routes
            gate_up=routed[0],
            down=routed[1],
            count=len(mine),
            first=mine.start,
            correction_bias=None if bias is None else up(as_float(bias).reshape(-1), norm=True),
            shared_gate_up=up(fused([p + "shared_experts.gate_proj.weight", p + "shared_experts.up_proj.weight"]))
            if shared else None,
            shared_down=down(p + "shared_experts.down_proj.weight") if shared else None,
        )

    def _keeps(self, weight: QuantizedWeight) -> bool:
        """Whether the op table chose a ``linear`` for this weight's method."""
        return weight.method in getattr(self.ops, "per_method", {})

    def to_device(self, array: HostWeight, norm: bool = False, pack: bool = True) -> Tensor:
        """``pack``: a quantized weight in the form the backend's ``linear`` reads; without it,
        the canonical form (routed experts: the ``moe`` op reads them, not ``linear``)."""
        if isinstance(array, QuantizedWeight):
            if not self._keeps(array):
                self._dequantized[array.method] += 1
                array = as_float(array)
            else:
                weight = upload_quantized(array, self.memory)
                return self.ops.pack_linear(weight) if pack else weight
        # norms stay in float32 whatever the compute dtype: they are tiny and precision-critical
        return self.memory.from_numpy(np.ascontiguousarray(array), "float32" if norm else self.dtype)

    def _fused_bias(self, parts: list[np.ndarray | None]) -> Tensor | None:
        if all(p is None for p in parts):
            return None
        if any(p is None for p in parts):
            raise CheckpointError("checkpoint has biases for some fused projections but not all")
        return self.to_device(np.concatenate(parts))  # type: ignore[arg-type]

    # -- forward ---------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
                meta: AttentionMetadata) -> Tensor:
        return self.run_layers(self.embed_tokens(input_ids), self.layers, positions, kv_caches, meta)

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The embeddings of ``input_ids`` (the vocabulary's ids). A tensor-parallel rank maps
        them to its slice's rows on the device, not the host: with asynchronous scheduling a
        step's ids come from the previous step's sample without leaving the device."""
        if self.vocab_rows is not None:
            input_ids = self.ops.embedding(self.vocab_rows, input_ids)[:, 0]
        return self.tp.reduce(self.ops.embedding(self.embed, input_ids))

    def run_layers(self, hidden: Tensor, layers: list[Layer], positions: Tensor,
                   kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata) -> Tensor:
        """``layers`` over ``hidden`` (one KV-cache layer each), then the final norm."""
        ops, eps = self.ops, self.config.rms_norm_eps
        n = hidden.shape[0]
        residual = None
        for layer, kv_cache in zip(layers, kv_caches):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = ops.rms_norm(hidden, layer.input_norm, eps, residual)
            hidden = self._attention(layer, x, positions, kv_cache, meta, n)
            x, residual = ops.rms_norm(hidden, layer.post_norm, eps, residual)
            if layer.experts is not None:
                hidden = self._sparse_mlp(layer.experts, x)
            else:
                gate_up = ops.linear(x, layer.gate_up, layer.gate_up_bias)
                hidden = self._row_parallel(ops.silu_and_mul(gate_up), layer.down, layer.down_bias)
        hidden, _ = ops.rms_norm(hidden, self.norm, eps, residual)
        return hidden

    def _sparse_mlp(self, experts: Experts, x: Tensor) -> Tensor:
        ops, spec = self.ops, self.moe
        assert spec is not None
        # expert_offset only where experts are dealt out: a backend's moe older than the
        # contract's 1.7 does not take it
        extra = {"expert_offset": experts.first} if experts.count < spec.num_experts else {}
        out = ops.moe(x, experts.router, experts.gate_up, experts.down, spec.top_k, spec.scoring,
                      spec.renormalize, experts.correction_bias, **extra)
        if experts.shared_gate_up is not None:
            out = out + ops.linear(ops.silu_and_mul(ops.linear(x, experts.shared_gate_up)), experts.shared_down)
        return self.tp.reduce(out) if self.tp.enabled else out

    def _row_parallel(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not self.tp.enabled:
            return self.ops.linear(x, weight, bias)
        out = self.tp.reduce(self.ops.linear(x, weight))
        return out if bias is None else out + bias  # once, after the ranks' partial sums

    def _attention(self, layer: Layer, x: Tensor, positions: Tensor, kv_cache: tuple[Tensor, Tensor],
                   meta: AttentionMetadata, n: int) -> Tensor:
        ops, eps = self.ops, self.config.rms_norm_eps
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        q = qkv[:, : self.q_size].reshape([n, self.num_heads, self.head_dim])
        k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape([n, self.num_kv_heads, self.head_dim])
        v = qkv[:, self.q_size + self.kv_size :].reshape([n, self.num_kv_heads, self.head_dim])
        if self.traits.qk_norm:
            q = ops.rms_norm(q, layer.q_norm, eps)
            k = ops.rms_norm(k, layer.k_norm, eps)
        if ops.has("rotary_attention"):  # the backend rotates q and k where it writes the cache
            out = ops.rotary_attention(positions, q, k, v, self.cos_sin, self.traits.rope_style, kv_cache, meta,
                                       self.scale)
        else:
            q, k = ops.rotary(positions, q, k, self.cos_sin, self.traits.rope_style)
            out = ops.attention(q, k, v, kv_cache, meta, self.scale)
        return self._row_parallel(out.reshape([n, self.q_size]), layer.o, layer.o_bias)

    def compute_logits(self, hidden: Tensor, row_indices: Tensor | None) -> Tensor:
        """Logits ``[len(row_indices), V]`` of the selected rows (None: every row, in order)."""
        # embedding is exactly a row gather
        rows = hidden if row_indices is None else self.ops.embedding(hidden, row_indices)
        logits = self.ops.linear(rows, self.lm_head)
        if not self.tp.enabled:
            return logits
        return self.tp.gather(logits)[:, : self.config.vocab_size]  # drop the vocabulary padding

    def weight_bytes(self) -> int:
        """Bytes of every tensor this rank holds on its device: ``named_parameters``, the final
        norm and an untied LM head; a quantized weight as its fields, whatever the backend's
        layout."""
        seen: set[int] = set()
        total = 0
        tensors = [t for _, t in self.named_parameters()] + [self.norm, self.lm_head]
        for t in tensors:
            parts = vars(t).values() if isinstance(t, QuantizedWeight) else [t]
            for part in parts:
                if hasattr(part, "element_size") and id(part) not in seen:  # a tied head once
                    seen.add(id(part))
                    total += int(part.numel()) * int(part.element_size())
        return total

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        yield "embed", self.embed
        for i, layer in enumerate(self.layers):
            for key, value in vars(layer).items():
                if isinstance(value, Experts):
                    for part, tensor in vars(value).items():
                        if isinstance(tensor, int):  # first, count: expert ids
                            continue
                        for e, t in enumerate(tensor) if isinstance(tensor, list) else [(None, tensor)]:
                            if t is not None:
                                yield f"layers.{i}.experts.{part}" + ("" if e is None else f".{e}"), t
                elif value is not None:
                    yield f"layers.{i}.{key}", value
