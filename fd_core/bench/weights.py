"""What a loaded model's weights occupy on its device, for the benchmarks' reports."""

from __future__ import annotations

from typing import Any

from fd_core.interfaces import QuantizedWeight


def weight_bytes(model: Any) -> int:
    """Bytes of every tensor a ``DecoderForCausalLM`` holds (a tied LM head counted once;
    a quantized weight as its packed fields)."""
    seen: set[int] = set()

    def size(t: Any) -> int:
        if t is None or id(t) in seen:
            return 0
        seen.add(id(t))
        if isinstance(t, QuantizedWeight):
            return size(t.qweight) + size(t.scales) + size(t.zeros)
        if not hasattr(t, "element_size"):
            return 0
        return int(t.numel()) * int(t.element_size())

    total = size(model.embed) + size(model.lm_head) + size(model.norm)
    for layer in model.layers:
        total += sum(size(value) for value in vars(layer).values())
    return total
