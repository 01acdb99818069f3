"""The CUDA backend's ops, under the exact signatures of ``fd_core.interfaces.ops.OP_SPECS``.

Each function is a thin wrapper over a Triton kernel in ``fd_backend_cuda.kernels``; the
semantics (and the tests) are those of ``fd_core.testing.spec``. What each kernel accepts is
listed in ``SUPPORTED`` and checked by ``supports``; a backend sends anything refused there, and
every op not listed in ``OPS``, to the reference implementation.

* Results are new tensors; the inputs are not modified, except the KV cache, which ``attention``
  writes in place as the contract says.
* ``rms_norm``/``rotary``/``silu_and_mul``: float32, float16, bfloat16; math in float32; any
  hidden size / head size (last axis contiguous, leading axes may be strided).
* ``attention``: q, k, v and the cache in float32, float16 or bfloat16 (the cache may differ from
  q: math is then float32), or an int8 / uint8 cache in fd_core.quantization.kv_cache's format
  (--kv-cache-dtype int8 / fp8_e4m3); head_dim up to 256 (a power of two is the fast path; others are
  padded to the next one); any block_size; Hq a multiple of Hk. Metadata is uploaded once per
  step into ``meta.device``.
* ``rotary_attention``: ``attention`` with q and k rotated by the kernel that writes the cache
  (``rotary``'s inputs and styles); a launch less per layer.
* ``linear`` for plain float16 / bfloat16 weights: the few-row kernel (``kernels/gemv.py``) for
  one to four rows (decode steps of one to four sequences), where it beat cuBLAS on an H200
  (``benchmarks/bench_gemv.py``), cuBLAS for everything else; registered apart from ``OPS``
  (``plugin.py``). Float32 weights stay on cuBLAS.
* ``linear`` / ``pack_linear`` for wint8, wint4 (zeros or not, per channel or groups of 16 and
  more) and block_wise_fp8 weights: registered apart from ``OPS`` (``plugin.py``), chosen per
  quantization method; plain weights go to cuBLAS.
* ``moe`` / ``pack_experts``: the fused MoE (``kernels/moe.py``): experts stacked once at load,
  tokens sorted and padded by expert on the device, two grouped GEMMs (SiLU-and-mul fused
  into the first, the routing weight into the second), float32 combine; plain float32 /
  float16 / bfloat16 experts and wint8, wint4, block_wise_fp8 ones; capturable in CUDA graphs.
  Registered apart from ``OPS`` (``plugin.py``) as one pair: the moe reads what its pack made.
* ``sample``: logits in float32, float16 or bfloat16 (math in float32), any vocabulary size; the
  token choice (greedy, temperature, top-k, top-p, min-p, the counter-based noise) and the raw
  logprob and rank in one Triton program per row without sorting; penalties and suppression
  through the torch reference's helpers, top logprobs with ``torch.topk``; one device-to-host
  copy. ``sample_async`` is the same, returned before that copy lands (pinned memory, an
  event), so the engine can queue the next step first.
* ``deferred_bitmask``: a grammar mask in pinned host memory that ``sample_async`` reads behind a
  device-side wait for the host's ``ready()`` (``deferred.py``), so the engine queues a step's
  sample before its mask is computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from fd_core.interfaces.ops import AttentionMetadata, SampleOutput, SamplingBatch
from fd_core.runtimes.torch.ops import linear as _torch_linear

from fd_backend_cuda.deferred import deferred_bitmask
from fd_backend_cuda.kernels.activation import silu_and_mul as _silu_and_mul
from fd_backend_cuda.kernels import gemv as _gemv
from fd_backend_cuda.kernels.attention import paged_attention as _paged_attention
# re-exported: plugin.py registers these under the op contract's names
from fd_backend_cuda.kernels.moe import moe, pack_experts  # noqa: F401
from fd_backend_cuda.kernels.quantized_linear import METHODS as QUANTIZED_METHODS  # noqa: F401
from fd_backend_cuda.kernels.quantized_linear import linear as quantized_linear  # noqa: F401
from fd_backend_cuda.kernels.quantized_linear import pack_linear  # noqa: F401
from fd_backend_cuda.kernels.rms_norm import rms_norm as _rms_norm
from fd_backend_cuda.kernels.rotary import rotary as _rotary
from fd_backend_cuda.kernels.sampling import DeviceSample
from fd_backend_cuda.kernels.sampling import sample as _sample
from fd_backend_cuda.kernels.sampling import sample_async as _sample_async

Tensor = torch.Tensor

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
MAX_HEAD_DIM = 256

# What each kernel accepts, in words and as data for ``supports``.
SUPPORTED: dict[str, dict] = {
    "rms_norm": {
        "dtypes": FLOAT_DTYPES,
        "note": "any H; rows in registers up to 8192, looped above",
    },
    "rotary": {
        "dtypes": FLOAT_DTYPES,
        "note": "neox | interleaved; any even R <= D; returns new q, k",
    },
    "silu_and_mul": {"dtypes": FLOAT_DTYPES, "note": "any even last dim"},
    "attention": {
        "dtypes": FLOAT_DTYPES,
        "max_head_dim": MAX_HEAD_DIM,
        "note": "head_dim <= 256 (power of two: no padding); any block_size; Hq % Hk == 0",
    },
    "rotary_attention": {
        "dtypes": FLOAT_DTYPES,
        "max_head_dim": MAX_HEAD_DIM,
        "note": "attention's kernels; q and k rotated in the K/V write's (one launch less a layer)",
    },
    "moe": {
        "dtypes": FLOAT_DTYPES,
        "note": "plain, wint8, wint4, block_wise_fp8 experts stacked by pack_experts; lists: the reference",
    },
    "sample": {
        "dtypes": FLOAT_DTYPES,
        "note": "any V; top-k/top-p by threshold search (no sort); math in float32",
    },
    "sample_async": {
        "dtypes": FLOAT_DTYPES,
        "note": "sample's kernel; the host copy is not waited for",
    },
    "deferred_bitmask": {
        "dtypes": FLOAT_DTYPES,
        "note": "pinned host mask behind cuStreamWaitValue32 on the sampling stream",
    },
}


def supports(op: str, dtype: torch.dtype | None = None, head_dim: int | None = None) -> bool:
    """Whether this backend's kernel for ``op`` takes inputs of ``dtype`` (and ``head_dim``)."""
    info = SUPPORTED.get(op)
    if info is None:
        return False
    if dtype is not None and dtype not in info["dtypes"]:
        return False
    limit = info.get("max_head_dim")
    return head_dim is None or limit is None or 0 < head_dim <= limit


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    return _rms_norm(x, weight, eps, residual)


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin: Tensor, style: str
) -> tuple[Tensor, Tensor]:
    return _rotary(positions, q, k, cos_sin, style)


def silu_and_mul(x: Tensor) -> Tensor:
    return _silu_and_mul(x)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_cache: tuple[Tensor, Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    return _paged_attention(q, k, v, kv_cache, meta, scale)


def rotary_attention(
    positions: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos_sin: Tensor,
    style: str,
    kv_cache: tuple[Tensor, Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> Tensor:
    """``rotary`` then ``attention``, the rotation done by the kernel that writes the cache."""
    return _paged_attention(q, k, v, kv_cache, meta, scale, rotary=(positions, cos_sin, style))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Plain weights: one to four rows through ``kernels/gemv.py``, cuBLAS otherwise. At three
    or four rows cuBLAS keeps the long-K shapes (Llama-3-8B's down projection, K 14,336:
    31.5 against 36 us on an H200); at one or two the kernel was ahead on every shape measured
    (ERNIE-4.5-0.3B's o projection: 3.0 against 12.7 us)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]  # checked first: most calls (prefill steps) end there
    if (rows <= _gemv.MAX_ROWS and (rows <= 2 or weight.shape[1] <= 8192) and isinstance(weight, torch.Tensor)
            and _gemv.supports(x2, weight)):
        return _gemv.gemv(x2, weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    return _torch_linear(x, weight, bias)


def sample(logits: Tensor, batch: SamplingBatch) -> SampleOutput:
    return _sample(logits, batch)


def sample_async(logits: Tensor, batch: SamplingBatch) -> DeviceSample:
    return _sample_async(logits, batch)


OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "rotary": rotary,
    "silu_and_mul": silu_and_mul,
    "attention": attention,
    "rotary_attention": rotary_attention,
    "sample": sample,
    "sample_async": sample_async,
    "deferred_bitmask": deferred_bitmask,
}
