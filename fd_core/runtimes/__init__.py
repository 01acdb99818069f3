"""The runtimes: the tensor libraries fd's reference ops, Memory and Communicator are written
for (``paddle``, ``torch``), and what they share."""

from __future__ import annotations

from typing import Any, Iterable

from fd_core.interfaces import Capabilities
from fd_core.interfaces.capabilities import SPECULATIVE_METHODS

# What each runtime's reference ops compute in on the host's CPU: PyTorch keeps a half dtype's
# tensors and KV cache in it (norms, softmax and sampling in float32); Paddle's CPU kernels are
# float32 only.
HOST_DTYPES: dict[str, frozenset[str]] = {
    "paddle": frozenset({"float32"}),
    "torch": frozenset({"float32", "bfloat16"}),
}


def reference_capabilities(dtypes: Iterable[str], **fields: Any) -> Capabilities:
    """The manifest of a platform whose ops are (or do what) a runtime's reference ops do, in
    ``dtypes``: attention over cached prefixes and mixed prefill chunks, KV swap through Memory,
    the speculative methods (their drafts are verified in decode rows of several tokens, which
    that attention computes); no graph capture and no weight-only quantization (fd quantizes
    nothing at load). ``fields`` sets the rest (collective library, device count, memory
    queries...)."""
    dtypes = frozenset(dtypes)
    return Capabilities(dtypes=dtypes, kv_cache_dtypes=dtypes, quantization=frozenset(), graph_capture=False,
                        prefix_caching=True, chunked_prefill=True, kv_swap=True,
                        speculative_methods=frozenset(SPECULATIVE_METHODS), **fields)
