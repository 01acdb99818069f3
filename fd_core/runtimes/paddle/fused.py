"""Adapters from the op contract to the fused kernels Paddle builds ship, for any Paddle device.

Each adapter has its op's exact signature (``fd_core.interfaces.ops``; the NumPy spec in
``fd_core.testing.spec`` is authoritative) and calls one fused kernel:

- ``rms_norm``: ``paddle.incubate.nn.functional.fused_rms_norm`` (with the residual add fused);
- ``silu_and_mul``: ``paddle.nn.functional.swiglu``;
- ``rotary``: ``paddle.incubate.nn.functional.fused_rotary_position_embedding``. Paddle names
  the styles the other way round from the contract: its ``use_neox_rotary_style=True`` rotates
  adjacent pairs (the contract's ``"interleaved"``), ``False`` rotates the two halves (the
  contract's ``"neox"``). The kernel rotates every dim of a head, so a partial rotary (R < D)
  rotates ``x[..., :R]`` and passes the rest through here.

Whether a kernel exists for a place depends on the Paddle build (CPU Paddle 3.3.1 has
``fused_rms_norm`` and ``swiglu`` but no ``fused_rotary_position_embedding``).
:func:`available` finds out once per
(op, place, dtype) by running the kernel on a tiny input and comparing it with Paddle's
reference (a kernel that runs but computes something else counts as unavailable);
:func:`register_fused` registers the adapters with a ``supports`` predicate that declines where
the kernel is unavailable, so the reference runs instead.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F

from fd_core.runtimes.paddle import ops as reference
from fd_core.runtimes.paddle.ops import _to, _upload, take_rows

log = logging.getLogger("fd.paddle.fused")

Tensor = paddle.Tensor

# op -> the Paddle kernel its adapter calls
KERNELS: dict[str, str] = {
    "rms_norm": "fused_rms_norm",
    "silu_and_mul": "swiglu",
    "rotary": "fused_rotary_position_embedding",
}
FUSED_OPS = tuple(KERNELS)
# the names the adapters are registered under (what fd doctor shows)
_NAMES = {"rms_norm": "fused_rms_norm", "silu_and_mul": "swiglu", "rotary": "fused_rope"}


# --- adapters ----------------------------------------------------------------------------------


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    # The kernel normalises over the axes from begin_norm_axis on (the last one here), with its
    # float32 accumulation; with ``residual`` it first forms x + residual and returns it too.
    out = IF.fused_rms_norm(
        x, _to(weight, x.dtype), None, eps, begin_norm_axis=x.ndim - 1,
        residual=None if residual is None else _to(residual, x.dtype),
    )
    if residual is None:
        return out[0]
    return out[0], out[1]


def silu_and_mul(x: Tensor) -> Tensor:
    return F.swiglu(x)


def _rope_kernel(q: Tensor, k: Tensor, sin: Tensor, cos: Tensor, adjacent: bool) -> tuple[Tensor, Tensor]:
    out_q, out_k, _ = IF.fused_rotary_position_embedding(
        q, k, None, sin=sin, cos=cos, position_ids=None, use_neox_rotary_style=adjacent, time_major=False
    )
    return out_q, out_k


def rotary(
    positions: Tensor, q: Tensor, k: Tensor, cos_sin: Tensor, style: str
) -> tuple[Tensor, Tensor]:
    if style not in ("neox", "interleaved"):
        raise ValueError(f"unknown rotary style {style!r}")
    n, dim = q.shape[0], q.shape[-1]
    if n == 0:
        return q, k
    rot = cos_sin.shape[-1]
    half = rot // 2
    cs = take_rows(cos_sin, positions)  # [N, R]
    cos, sin = cs[:, :half], cs[:, half:]
    adjacent = style == "interleaved"
    # The kernel reads one cos/sin per rotated dim: [c0, c0, c1, c1, ...] for adjacent pairs,
    # [c0 .. c(R/2-1), c0 .. c(R/2-1)] for halves; token t of the [1, N, H, R] batch uses row t.
    if adjacent:
        cos, sin = (paddle.stack([c, c], axis=-1).reshape([n, rot]) for c in (cos, sin))
    else:
        cos, sin = (paddle.concat([c, c], axis=-1) for c in (cos, sin))
    cos, sin = (_to(c, q.dtype).reshape([1, n, 1, rot]) for c in (cos, sin))
    partial = rot != dim

    def head(x: Tensor) -> Tensor:
        x = x[..., :rot] if partial else x
        return x.reshape([1, n, x.shape[1], rot])

    out_q, out_k = _rope_kernel(head(q), head(k), sin, cos, adjacent)
    out_q, out_k = out_q.reshape([n, q.shape[1], rot]), out_k.reshape([n, k.shape[1], rot])
    if partial:
        out_q = paddle.concat([out_q, q[..., rot:]], axis=-1)
        out_k = paddle.concat([out_k, k[..., rot:]], axis=-1)
    return out_q, out_k


ADAPTERS: dict[str, Callable[..., Any]] = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "rotary": rotary}


# --- availability ------------------------------------------------------------------------------


def _tensor(array: np.ndarray, place: str, dtype: str) -> Tensor:
    return _to(_upload(array, paddle.device.device_to_place(place)), getattr(paddle, dtype))


def _probe_case(op: str, place: str, dtype: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """``(fused, reference)`` thunks on a tiny input on ``place`` in ``dtype``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16)).astype(np.float32)

    def t(a: np.ndarray, dt: str = dtype) -> Tensor:
        return _tensor(a, place, dt)

    if op == "rms_norm":
        w, r = rng.standard_normal(16).astype(np.float32), rng.standard_normal((3, 16)).astype(np.float32)
        return (lambda: rms_norm(t(x), t(w), 1e-6, t(r)), lambda: reference.rms_norm(t(x), t(w), 1e-6, t(r)))
    if op == "silu_and_mul":
        return lambda: silu_and_mul(t(x)), lambda: _silu_and_mul_composed(t(x))
    if op == "rotary":
        q = rng.standard_normal((3, 2, 8)).astype(np.float32)
        k = rng.standard_normal((3, 1, 8)).astype(np.float32)
        angles = np.arange(5)[:, None] / 10000 ** (np.arange(0, 8, 2)[None, :] / 8)
        cs = np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
        pos = np.array([0, 4, 2], np.int64)

        def both_styles(fn: Callable[..., Any]) -> Callable[[], Any]:
            def run() -> list[Tensor]:
                return [out for style in ("neox", "interleaved")
                        for out in fn(t(pos, "int64"), t(q), t(k), t(cs, "float32"), style)]
            return run

        return both_styles(rotary), both_styles(reference.rotary)
    raise ValueError(f"no fused kernel probe for {op!r}; known: {sorted(KERNELS)}")


def _silu_and_mul_composed(x: Tensor) -> Tensor:
    # not the runtime's reference op, which is swiglu itself
    h = _to(x, paddle.float32)
    half = h.shape[-1] // 2
    return _to(F.silu(h[:, :half]) * h[:, half:], x.dtype)


def _flat(result: Any) -> list[np.ndarray]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [_to(r, paddle.float32).numpy() for r in items]


_PROBED: dict[tuple[str, str, str], tuple[bool, str]] = {}


def probe(op: str, place: str, dtype: str = "float32") -> tuple[bool, str]:
    """Whether ``op``'s fused kernel runs on ``place`` in ``dtype`` and agrees with Paddle's
    reference on a tiny input, and if not, why. Cached per (op, place, dtype)."""
    key = (op, place, dtype)
    if key not in _PROBED:
        try:
            fused, ref = _probe_case(op, place, dtype)
            tol = 1e-4 if dtype in ("float32", "float64") else 5e-2
            for g, w in zip(_flat(fused()), _flat(ref()), strict=True):
                np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
            _PROBED[key] = (True, "")
        except Exception as exc:  # noqa: BLE001 - not registered, unsupported dtype, wrong result...
            why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            _PROBED[key] = (False, why)
            log.debug("fused kernel %s unavailable on %s for %s: %s", KERNELS.get(op, op), place, dtype, why)
    return _PROBED[key]


def available(op: str, place: str, dtype: str = "float32") -> bool:
    """Whether ``op``'s fused kernel can serve on ``place`` in ``dtype`` (see :func:`probe`)."""
    return probe(op, place, dtype)[0]


def _dtype_name(dtype: Any) -> str:
    return "float32" if dtype is None else str(dtype).split(".")[-1]


def supports(op: str, place: Callable[[], str]) -> Callable[..., bool]:
    """The ``supports`` predicate of ``op``'s adapter: the kernel is available on ``place()``
    for the configuration's dtype (and, for rotary, the head size is even)."""

    def check(dtype: Any = None, head_dim: int | None = None, quantization: str | None = None, **_: Any) -> bool:
        if op == "rotary" and head_dim is not None and head_dim % 2:
            return False
        return available(op, place(), _dtype_name(dtype))

    return check


def register_fused(registry: Any, device_type: str, place: Callable[[], str],
                   ops: tuple[str, ...] = FUSED_OPS, priority: int = 10) -> None:
    """Register the adapters of ``ops`` for ``device_type`` on the Paddle runtime. ``place()``
    names the place their kernels run on (called when an engine selects its ops)."""
    for op in ops:
        registry.register(op, device_type, ADAPTERS[op], name=_NAMES[op], priority=priority,
                          supports=supports(op, place), runtime="paddle")


def probe_report(place: str, dtypes: tuple[str, ...] = ("float32",)) -> Mapping[str, dict[str, str]]:
    """``{kernel: {dtype: "ok" | why not}}`` for every kernel this module knows, on ``place``."""
    return {
        KERNELS[op]: {dt: (lambda r: "ok" if r[0] else r[1])(probe(op, place, dt)) for dt in dtypes}
        for op in KERNELS
    }
