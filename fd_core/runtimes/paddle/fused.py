"""Adapters from the op contract to the fused kernels Paddle builds ship, for any Paddle device.

Each adapter has its op's exact signature (``fd_core.interfaces.ops``; the NumPy spec in
``fd_core.testing.spec`` is authoritative) and calls one fused kernel:

- ``rms_norm``: ``paddle.incubate.nn.functional.fused_rms_norm`` (with the residual add fused);
- ``silu_and_mul``: ``paddle.nn.functional.swiglu``;
- ``linear`` (wint8/wint4 weights only) and ``pack_linear``: ``paddle.nn.quant.weight_only_linear``
  over the layout ``weight_quantize`` makes at load (GPU-class builds; not on the CPU);
- ``moe``: ``paddle.incubate.nn.functional.moe_gate_dispatch`` and ``moe_combine`` around the
  experts' products (``fused_moe.py`` says what it relies on);
- ``rotary``: ``paddle.incubate.nn.functional.fused_rotary_position_embedding``. Paddle names
  the styles the other way round from the contract: its ``use_neox_rotary_style=True`` rotates
  adjacent pairs (the contract's ``"interleaved"``), ``False`` rotates the two halves (the
  contract's ``"neox"``). The kernel rotates every dim of a head, so a partial rotary (R < D)
  rotates ``x[..., :R]`` and passes the rest through here.

Whether a kernel exists for a place depends on the Paddle build (CPU Paddle 3.3.1 has
``fused_rms_norm`` and ``swiglu`` but no ``fused_rotary_position_embedding``), and on the CPU
place also on the CPU (3.3.1's CPU ``fused_rms_norm`` dies with SIGILL on a CPU without AVX-512).
:func:`probe` finds out once per (op, place, dtype) by running the kernel on a tiny input and
comparing it with Paddle's reference (a kernel that runs but computes something else counts as
unavailable). On a device place it runs in this process (a failing kernel raises); on the CPU
place in a child process, all kernels and dtypes at once, so that a kernel that kills its
process (SIGILL...) is declined with the signal as the reason instead of ending the engine; the
CPU's answers are also cached across processes (see the comment above ``_CHILD_DTYPES``).
:func:`register_fused` registers the adapters with a ``supports`` predicate that declines where
the kernel is unavailable, so the reference runs instead; the predicate's ``why`` gives the
probe's reason to ``fd doctor``. :func:`probe_report` lists every kernel's answer.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Callable, Mapping

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F

from fd_core.host import cpu_flags as _cpu_flags  # the tests replace it here
from fd_core.interfaces import QuantizedWeight
from fd_core.runtimes.paddle import fused_moe
from fd_core.runtimes.paddle import ops as reference
from fd_core.runtimes.paddle.ops import _to, _upload, take_rows

log = logging.getLogger("fd.paddle.fused")

Tensor = paddle.Tensor

# op -> the Paddle kernel its adapter calls
KERNELS: dict[str, str] = {
    "rms_norm": "fused_rms_norm",
    "silu_and_mul": "swiglu",
    "rotary": "fused_rotary_position_embedding",
    "linear": "weight_only_linear",  # quantized weights only (with weight_quantize at load)
    "moe": "moe_gate_dispatch",  # with moe_combine
}
FUSED_OPS = tuple(KERNELS)
# the names the adapters are registered under (what fd doctor shows)
_NAMES = {"rms_norm": "fused_rms_norm", "silu_and_mul": "swiglu", "rotary": "fused_rope",
          "linear": "weight_only_linear", "pack_linear": "weight_only_linear", "moe": "moe_gate_dispatch"}


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


WEIGHT_ONLY = {"wint8": "int8", "wint4": "int4"}  # method -> weight_only_linear's weight_dtype
_WEIGHT_ONLY_GROUPS = (-1, 64, 128)  # the group sizes weight_quantize takes


def pack_linear(weight: QuantizedWeight) -> QuantizedWeight:
    """A canonical wint8/wint4 weight in Paddle's weight-only layout (``weight_quantize`` on its
    dequantized values: a symmetric weight with one scale per channel or per group of 64 or
    128 lands on the same integers and scales, since its largest value in each group is
    ``127 s`` or ``7 s``). Zero points and other groups have no Paddle form: they stay canonical
    and ``linear`` runs the reference on them."""
    if weight.method not in WEIGHT_ONLY or weight.zeros is not None or weight.group_size not in _WEIGHT_ONLY_GROUPS:
        return weight
    # float16, not bfloat16: its 11-bit significand keeps q * s close enough to round back to q
    dense = reference.dequantize(weight, paddle.float16)
    algo = f"weight_only_{WEIGHT_ONLY[weight.method]}"
    qweight, scales = paddle.nn.quant.weight_quantize(dense.T, algo=algo, group_size=weight.group_size)
    return QuantizedWeight(weight.method, qweight, scales, weight.group_size, weight.shape, None, "paddle_weight_only")


def linear(x: Tensor, weight: Any, bias: Tensor | None = None) -> Tensor:
    if not isinstance(weight, QuantizedWeight) or weight.layout != "paddle_weight_only":
        return reference.linear(x, weight, bias)
    scales = weight.scales if weight.scales.dtype == x.dtype else _to(weight.scales, x.dtype)
    return paddle.nn.quant.weight_only_linear(x, weight.qweight, bias=None if bias is None else _to(bias, x.dtype),
                                              weight_scale=scales, weight_dtype=WEIGHT_ONLY[weight.method],
                                              group_size=weight.group_size)


ADAPTERS: dict[str, Callable[..., Any]] = {"rms_norm": rms_norm, "silu_and_mul": silu_and_mul, "rotary": rotary,
                                           "linear": linear, "pack_linear": pack_linear, "moe": fused_moe.moe}


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
    if op == "linear":  # a per-channel wint8 weight through weight_quantize and weight_only_linear
        from fd_core.quantization.quantize import quantize

        w = quantize((rng.standard_normal((64, 16)) * 0.25).astype(np.float32), "wint8", -1)

        def on_place() -> QuantizedWeight:
            return QuantizedWeight("wint8", t(w.qweight, "int8"), t(w.scales, "float32"), -1, w.shape)

        return (lambda: linear(t(x), pack_linear(on_place())), lambda: reference.linear(t(x), on_place()))
    if op == "moe":  # 4 experts, top-2 with a correction bias: ties, uneven counts, an idle expert
        router = rng.standard_normal((4, 16)).astype(np.float32)
        bias = np.array([0.0, 0.3, -0.2, 0.1], np.float32)
        gate_up = [rng.standard_normal((16, 16)).astype(np.float32) * 0.25 for _ in range(4)]
        down = [rng.standard_normal((16, 8)).astype(np.float32) * 0.35 for _ in range(4)]

        def run(fn: Callable[..., Any]) -> Callable[[], Any]:
            return lambda: fn(t(x), t(router), [t(w) for w in gate_up], [t(w) for w in down], 2, "softmax", True,
                              t(bias, "float32"))

        return run(fused_moe.moe), run(reference.moe)
    raise ValueError(f"no fused kernel probe for {op!r}; known: {sorted(KERNELS)}")


def _silu_and_mul_composed(x: Tensor) -> Tensor:
    # not the runtime's reference op, which is swiglu itself
    h = _to(x, paddle.float32)
    half = h.shape[-1] // 2
    return _to(F.silu(h[:, :half]) * h[:, half:], x.dtype)


def _flat(result: Any) -> list[np.ndarray]:
    items = result if isinstance(result, (tuple, list)) else [result]
    return [_to(r, paddle.float32).numpy() for r in items]


def _check(op: str, place: str, dtype: str,
           case: Callable[[str, str, str], tuple[Callable[[], Any], Callable[[], Any]]] = _probe_case
           ) -> tuple[bool, str]:
    """Run ``op``'s kernel once in this process and compare it with the reference: ``(ok, why)``.
    An exception is a reason; a fault in the kernel (SIGILL...) ends this process."""
    try:
        fused, ref = case(op, place, dtype)
        tol = 1e-4 if dtype in ("float32", "float64") else 5e-2
        for g, w in zip(_flat(fused()), _flat(ref()), strict=True):
            np.testing.assert_allclose(g, w, rtol=tol, atol=tol)
        return True, ""
    except Exception as exc:  # noqa: BLE001 - not registered, unsupported dtype, wrong result...
        return False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


_PROBED: dict[tuple[str, str, str], tuple[bool, str]] = {}
_LOCK = threading.Lock()


def probe(op: str, place: str, dtype: str = "float32") -> tuple[bool, str]:
    """Whether ``op``'s fused kernel runs on ``place`` in ``dtype`` and agrees with Paddle's
    reference on a tiny input, and if not, why. Cached per (op, place, dtype) in this process;
    on the CPU place the kernels run in a child process (see :func:`_probe_cpu`)."""
    key = (op, place, dtype)
    with _LOCK:
        if key not in _PROBED:
            if _is_cpu(place):
                _probe_cpu(place, dtype, op)
            else:  # a device kernel that fails raises; it does not kill the process
                _record(key, _check(op, place, dtype), loud=False)
        return _PROBED[key]


def _record(key: tuple[str, str, str], result: tuple[bool, str], loud: bool) -> None:
    _PROBED[key] = result
    if not result[0]:
        op, place, dtype = key
        # a kernel that killed its probe process is news to whoever wonders why the reference runs
        log.log(logging.WARNING if loud else logging.DEBUG, "fused kernel %s declined on %s for %s: %s",
                KERNELS.get(op, op), place, dtype, result[1])


# --- the CPU place: probing in a child process -------------------------------------------------
#
# A CPU kernel built for instructions this CPU lacks (Paddle 3.3.1's CPU fused_rms_norm on a CPU
# without AVX-512) dies with SIGILL, which no try/except catches: probed in-process it would take
# the engine down. On the CPU place every kernel (for every dtype in _CHILD_DTYPES, plus the one
# asked for) is therefore run by one child process, `python -c _CHILD`:
#
#   parent -> child stdin:  {"place": "cpu", "cases": [[op, dtype], ...], "overrides": {...},
#                            "path": [the parent's sys.path, which the child puts first]}
#   child -> parent stdout: one line "fd-probe {"start": [op, dtype]}" before running a case and
#                           one line "fd-probe {"done": [op, dtype], "ok": bool, "why": str}"
#                           after it (other output is ignored).
#
# The child resets the fatal-signal handlers Paddle installs (glog's stack dumper: slow, and under
# QEMU it hangs) so that a faulting kernel ends it at once. A child that dies after "start" without
# "done" declines that case with the signal (or exit status) as the reason, and a new child probes
# the cases it did not reach; one that fails before any case (or runs past CHILD_TIMEOUT_S)
# declines every case it had.
#
# Results are also cached across processes, in a small JSON file under the user's cache dir
# ($XDG_CACHE_HOME/fd, else ~/.cache/fd) keyed by Paddle's version and location, the Python
# executable, the CPU's flags and this file's contents. Measured on the 2-core dev machine
# (Paddle 3.3.1, AVX-512): one child probing all 9 cases costs 1.1-1.4 s of wall time (up to
# 2.5 s when the cores are busy; importing paddle is most of it), two children (the first killed
# by SIGILL, as on an AVX2-only CPU) 2.3-2.7 s, a cache hit 0.5 ms; `FD_EMULATE=xpu fd doctor`
# takes 2.7 s with the children and 1.3-1.4 s with the cache. Under QEMU (qemu-x86_64 -cpu
# Haswell-v4, where fused_rms_norm dies) the two children take 23 s: fd doctor 26.8 s, 10.0 s
# cached. Without the file that cost would be paid by every process that selects an op table
# (each engine, each tensor-parallel worker, each fd doctor, each test process), for an answer
# that only changes with Paddle, Python, the CPU or this file, which are the key. Only definite
# answers are cached (a result, or a death by a fault signal), never a timeout or a child that
# could not start; where the CPU flags are unknown (not Linux) nothing is cached; a corrupt or
# unwritable cache file is ignored.

# The dtypes one child probes, besides the one asked for: each case costs milliseconds beside the
# child's start-up, and the engine, fd doctor and the tests ask for these.
_CHILD_DTYPES = ("float32", "float16", "bfloat16")
# How long one child may take; a child past it is killed and its unanswered cases are declined.
CHILD_TIMEOUT_S = 300.0
# For tests only: op -> "module:function" building that op's ``(fused, reference)`` thunks in the
# child, called as function(op, place, dtype) instead of the real case, e.g. one that kills its
# process with os.kill(os.getpid(), signal.SIGILL) to stand for a kernel this CPU cannot run.
# The module must be importable with the parent's sys.path. While any is set, the cross-process
# cache is neither read nor written.
CHILD_CASE_OVERRIDES: dict[str, str] = {}

_PREFIX = "fd-probe "
# Signals a kernel raises itself (its answer is the same next time, so it is cached); SIGKILL,
# SIGTERM and the like come from outside and are not.
_FAULTS = {getattr(signal, name) for name in ("SIGILL", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGABRT")
           if hasattr(signal, name)}
_CACHE_FORMAT = 1
_CACHE_ENTRIES = 8  # keys kept in the file (several venvs or Paddle versions), newest last


def _is_cpu(place: str) -> bool:
    return place.split(":")[0] == "cpu"


def _death(kernel: str, returncode: int, last: str = "") -> tuple[str, bool]:
    """Why a child that was running ``kernel``'s case ended with ``returncode`` (``last``: the
    last line it wrote to stderr), and whether that answer may be cached."""
    if returncode >= 0:
        return (f"{kernel}'s probe process exited with status {returncode} before answering"
                + (f": {last}" if last else "")), False
    try:
        sig = signal.Signals(-returncode)
    except ValueError:
        return f"{kernel} killed its probe process with signal {-returncode}", False
    why = f"{kernel} killed its probe process with {sig.name} ({signal.strsignal(sig) or sig.name})"
    if sig == signal.SIGILL:
        flags = _cpu_flags()
        if flags is not None and "avx512f" not in flags:
            why += "; this CPU has no AVX-512 (no avx512f among its flags in /proc/cpuinfo)"
    return why, sig in _FAULTS


def _run_child(place: str, cases: list[tuple[str, str]]) -> tuple[
        dict[tuple[str, str], tuple[bool, str]], tuple[str, str] | None, str, bool]:
    """One child over ``cases``: ``(answers, the case it died in or None, why it died, whether
    that is cacheable)``; ``why`` is "" when the child answered every case."""
    request = {"place": place, "cases": cases, "overrides": dict(CHILD_CASE_OVERRIDES),
               "path": [p for p in sys.path if isinstance(p, str)]}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(request), capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S, check=False)
        out, err, returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, err, returncode = _text(exc.stdout), _text(exc.stderr), None
    except (OSError, ValueError) as exc:
        return {}, None, f"the probe process could not start ({type(exc).__name__}: {exc})", False
    answers: dict[tuple[str, str], tuple[bool, str]] = {}
    started: tuple[str, str] | None = None
    for line in out.splitlines():
        if not line.startswith(_PREFIX):
            continue
        try:
            msg = json.loads(line[len(_PREFIX):])
            if "start" in msg:
                started = (str(msg["start"][0]), str(msg["start"][1]))
            else:
                answers[(str(msg["done"][0]), str(msg["done"][1]))] = (bool(msg["ok"]), str(msg["why"]))
                started = None
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    if returncode is None:
        kernel = KERNELS.get(started[0], started[0]) if started else "paddle"
        return answers, started, (f"{'the ' + kernel + ' kernel' if started else 'the probe process'} did "
                                  f"not answer within {CHILD_TIMEOUT_S:g} s"), False
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "")
    if started is not None:
        why, cacheable = _death(KERNELS.get(started[0], started[0]), returncode, last)
        return answers, started, why, cacheable
    if len(answers) < len(cases):
        return answers, None, (f"the probe process ended (status {returncode}) before probing"
                               + (f": {last}" if last else "")), False
    return answers, None, "", False


def _text(data: Any) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _probe_cpu(place: str, dtype: str, op: str) -> None:
    """Fill :data:`_PROBED` for every kernel on the CPU ``place`` in ``_CHILD_DTYPES`` and
    ``dtype`` (and for ``op``, known or not): from the cache file, else from child processes."""
    dtypes = tuple(dict.fromkeys((*_CHILD_DTYPES, dtype)))
    ops = tuple(dict.fromkeys((*KERNELS, op)))
    wanted = [(o, dt) for o in ops for dt in dtypes if (o, place, dt) not in _PROBED]
    key = None if CHILD_CASE_OVERRIDES else _cache_key()
    cached = _cache_read(key, place) if key else {}
    # case -> (ok, why, whether the process died of it: logged as a warning)
    results = {c: cached[c] for c in wanted if c in cached}
    fresh: dict[tuple[str, str], tuple[bool, str, bool]] = {}  # what may go to the cache file
    todo = [c for c in wanted if c not in cached]
    while todo:
        answers, died_in, why, cacheable = _run_child(place, todo)
        for c, (ok, reason) in answers.items():
            if c in todo:
                results[c] = fresh[c] = (ok, reason, False)
        todo = [c for c in todo if c not in answers]
        if died_in is not None and died_in in todo:
            results[died_in] = (False, why, True)
            if cacheable:
                fresh[died_in] = results[died_in]
            todo.remove(died_in)
        elif todo:  # the child could not probe at all: every case left gets its reason
            for c in todo:
                results[c] = (False, why, True)
            todo = []
    for (o, dt), (ok, why, died) in results.items():
        _record((o, place, dt), (ok, why), died)
    if key and fresh:
        _cache_write(key, place, fresh)


# The child's program: it imports fd_core (and the overrides' modules) as the parent does, from
# the parent's sys.path.
_CHILD = ("import json, sys; request = json.load(sys.stdin); "
          "sys.path[:0] = [p for p in request['path'] if p not in sys.path]; "
          "from fd_core.runtimes.paddle.fused import _child_main; _child_main(request)")


def _child_main(request: Mapping[str, Any]) -> None:
    """The child's side of the protocol above: probe each case of ``request``."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    except (ImportError, ValueError, OSError):
        pass  # no core files from a kernel that faults, where the platform allows
    place, overrides = request["place"], request.get("overrides", {})
    for op, dtype in request["cases"]:
        for sig in _FAULTS:  # the default action: a faulting kernel ends this process at once
            signal.signal(sig, signal.SIG_DFL)
        print(_PREFIX + json.dumps({"start": [op, dtype]}), flush=True)
        case = _probe_case
        if op in overrides:
            module, _, name = overrides[op].partition(":")
            case = getattr(importlib.import_module(module), name)
        ok, why = _check(op, place, dtype, case)
        print(_PREFIX + json.dumps({"done": [op, dtype], "ok": ok, "why": why}), flush=True)


# --- the cross-process cache (see the comment above _CHILD_DTYPES) -----------------------------


def _cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # unset, empty or relative: the XDG default
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fd", "fused_probe.json")


def _cache_key() -> str | None:
    """What the CPU probe's answers depend on, hashed; None where the CPU flags are unknown."""
    flags = _cpu_flags()
    if flags is None:
        return None
    try:
        digest = hashlib.sha256()
        for path in (__file__, fused_moe.__file__):  # the adapters the child runs
            with open(path, "rb") as f:
                digest.update(f.read())
        source = digest.hexdigest()
    except OSError:
        return None
    parts = [paddle.__version__, getattr(paddle.version, "commit", ""), os.path.dirname(paddle.__file__),
             sys.executable, sys.version, " ".join(sorted(flags)), source]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _cache_load() -> dict[str, Any]:
    try:
        with open(_cache_path()) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("format") == _CACHE_FORMAT and isinstance(data.get("entries"), dict):
            return data
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    return {"format": _CACHE_FORMAT, "entries": {}}


def _cache_read(key: str, place: str) -> dict[tuple[str, str], tuple[bool, str, bool]]:
    """``{(op, dtype): (ok, why, died)}`` cached for ``key`` on ``place``; entries of any
    other shape are ignored."""
    entry = _cache_load()["entries"].get(key)
    found: dict[tuple[str, str], tuple[bool, str, bool]] = {}
    if not isinstance(entry, dict):
        return found
    for name, value in entry.items():
        parts = str(name).split("/")
        if (len(parts) == 3 and parts[1] == place and isinstance(value, list) and len(value) == 3
                and isinstance(value[0], bool) and isinstance(value[1], str) and isinstance(value[2], bool)):
            found[(parts[0], parts[2])] = (value[0], value[1], value[2])
    return found


def _cache_write(key: str, place: str, results: Mapping[tuple[str, str], tuple[bool, str, bool]]) -> None:
    path = _cache_path()
    try:
        data = _cache_load()
        entry = data["entries"].pop(key, None)
        entry = entry if isinstance(entry, dict) else {}
        entry.update({f"{op}/{place}/{dt}": list(result) for (op, dt), result in results.items()})
        data["entries"][key] = entry  # newest last
        for old in list(data["entries"])[:-_CACHE_ENTRIES]:
            del data["entries"][old]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fused_probe.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:  # a read-only home, a full disk...: probe again next time
        log.debug("could not write the fused-kernel probe cache %s: %s", path, exc)


def available(op: str, place: str, dtype: str = "float32") -> bool:
    """Whether ``op``'s fused kernel can serve on ``place`` in ``dtype`` (see :func:`probe`)."""
    return probe(op, place, dtype)[0]


def _dtype_name(dtype: Any) -> str:
    return "float32" if dtype is None else str(dtype).split(".")[-1]


def supports(op: str, place: Callable[[], str]) -> Callable[..., bool]:
    """The ``supports`` predicate of ``op``'s adapter: the kernel is available on ``place()``
    for the configuration's dtype (and, for rotary, the head size is even). Its ``why``
    attribute, called with the same arguments, says why it declines (``fd doctor`` shows it)."""

    def check(dtype: Any = None, head_dim: int | None = None, quantization: str | None = None, **_: Any) -> bool:
        if op == "rotary" and head_dim is not None and head_dim % 2:
            return False
        if op == "linear" and quantization not in WEIGHT_ONLY:
            return False  # plain weights: Paddle's matmul (the reference)
        return available(op, place(), _dtype_name(dtype))

    def why(dtype: Any = None, head_dim: int | None = None, quantization: str | None = None, **_: Any) -> str:
        if op == "rotary" and head_dim is not None and head_dim % 2:
            return f"the kernel rotates pairs of dims; head size {head_dim} is odd"
        if op == "linear" and quantization not in WEIGHT_ONLY:
            return "it serves wint8 and wint4 weights only"
        where, dt = place(), _dtype_name(dtype)
        ok, reason = probe(op, where, dt)
        return "" if ok else f"probed on {where} for {dt}: {reason}"

    check.why = why  # type: ignore[attr-defined]
    return check


def register_fused(registry: Any, device_type: str, place: Callable[[], str],
                   ops: tuple[str, ...] = FUSED_OPS, priority: int = 10) -> None:
    """Register the adapters of ``ops`` for ``device_type`` on the Paddle runtime. ``place()``
    names the place their kernels run on (called when an engine selects its ops)."""
    for op in ops:
        registry.register(op, device_type, ADAPTERS[op], name=_NAMES[op], priority=priority,
                          supports=supports(op, place), runtime="paddle")
        if op == "linear":  # its load-time half, chosen with it
            registry.register("pack_linear", device_type, pack_linear, name=_NAMES["pack_linear"],
                              priority=priority, supports=supports(op, place), runtime="paddle")


def probe_report(place: str, dtypes: tuple[str, ...] = ("float32",)) -> Mapping[str, dict[str, str]]:
    """``{kernel: {dtype: "ok" | why not}}`` for every kernel this module knows, on ``place``."""
    return {
        KERNELS[op]: {dt: (lambda r: "ok" if r[0] else r[1])(probe(op, place, dt)) for dt in dtypes}
        for op in KERNELS
    }
