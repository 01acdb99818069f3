"""Weight-only quantized ``linear`` on the CPU through PyTorch's packed kernels (``--runtime torch``).

PyTorch ships two CPU kernels that read integer weights directly, vectorised and spread over the
cores by ATen: ``_weight_int4pack_mm_for_cpu`` (unsigned 4-bit ``u``, group-wise scales and zeros:
``(u - 8) * scale + zero``, our canonical wint4 with ``u = q + 8``) and ``_weight_int8pack_mm``
(int8, one scale per output row). Both are fast only with bfloat16 activations — measured on the 2-core
AVX-512 EPYC, ``[1, 576] x [1536, 576]``: int4 54 us with bfloat16 against 758 us with float32,
float32 dense 76 us with the weight in cache — so the activations are rounded to bfloat16 for the
product and the result comes back in the caller's dtype (llama.cpp rounds its activations to 8
bits for the same reason). docs/PERFORMANCE.md has the model-level figures.

Layouts made once at load by ``pack_linear``:

- ``cpu_int4pack``: wint4 with a group of 32, 64, 128 or 256 and ``out`` a multiple of 16.
- ``cpu_int8pack``: wint8 with one scale per row (``group_size`` -1 or ``in``).
- ``cpu_blocks_q4_1`` / ``cpu_blocks_q8_0``: on a CPU with AVX2 and no AVX-512, where ATen's int4
  kernel is not vectorised, wint4 and wint8 in groups of a multiple of 32 (GGUF's Q4_1 and Q8_0)
  through ``blocks.py``'s kernels, with float32 activations.
- ``cpu_bf16``: anything else (group-wise wint8 such as GGUF's Q8_0 and Q6_K), dequantized once to
  bfloat16 — half float32's bytes, no per-call dequantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fd_core.backends.cpu import blocks
from fd_core.interfaces import QuantizedWeight
from fd_core.runtimes.torch.ops import dequantize
from fd_core.runtimes.torch.ops import linear as reference_linear

INT4_GROUPS = (32, 64, 128, 256)
_BF16 = torch.bfloat16


def pack_linear(weight: QuantizedWeight) -> QuantizedWeight:
    if blocks.fits(weight) and blocks.usable():
        return blocks.pack(weight)
    out_features, in_features = weight.shape
    group = in_features if weight.group_size == -1 else weight.group_size
    if weight.method == "wint4" and group in INT4_GROUPS and out_features % 16 == 0 and in_features % group == 0:
        unsigned = (weight.qweight.to(torch.int32) + 8).contiguous()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
        zeros = torch.zeros_like(weight.scales) if weight.zeros is None else weight.zeros
        # [in / group, out, 2]: each group's scale and zero for every output row
        scale_zero = torch.stack([weight.scales.t(), zeros.t()], dim=-1).to(_BF16).contiguous()
        return QuantizedWeight("wint4", packed, scale_zero, group, weight.shape, None, "cpu_int4pack")
    if weight.method == "wint8" and group == in_features:
        zeros = None if weight.zeros is None else weight.zeros.reshape(-1).to(_BF16)
        return QuantizedWeight("wint8", weight.qweight.contiguous(), weight.scales.reshape(-1).to(_BF16).contiguous(),
                               -1, weight.shape, zeros, "cpu_int8pack")
    dense = dequantize(weight, _BF16).contiguous()
    return QuantizedWeight(weight.method, dense, weight.scales, weight.group_size, weight.shape, None, "cpu_bf16")


def linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.layout in blocks.FUNCTIONS:
        y = blocks.linear(x, weight)
        return y if bias is None else y + bias.to(x.dtype)
    h = x.to(_BF16)
    if weight.layout == "cpu_int4pack":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(h, weight.qweight, weight.group_size, weight.scales)
    elif weight.layout == "cpu_int8pack":
        y = torch.ops.aten._weight_int8pack_mm(h, weight.qweight, weight.scales)
        if weight.zeros is not None:  # x @ (q s + z)^T = (x @ q^T) s + rowsum(x) z
            y = y + h.sum(-1, keepdim=True) * weight.zeros
    elif weight.layout == "cpu_bf16":
        y = F.linear(h, weight.qweight)
    else:  # the canonical form (no pack_linear ran)
        return reference_linear(x, weight, bias)
    y = y.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)
