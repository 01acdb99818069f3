"""Op registration and the once-per-start-up selection of an op table."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from fd_core.errors import ConfigError
from fd_core.interfaces import API_VERSION, FUSED_OPS, OP_SPECS, QuantizedWeight
from fd_core.interfaces.version import at_least
from fd_core.plugins.signatures import mismatch

log = logging.getLogger("fd.ops")

Supports = Callable[..., bool]

# chosen again for each quantization method a model's weights use
QUANTIZED_OPS = ("linear", "pack_linear")


def _always(**_: Any) -> bool:
    return True


def op_context(dtype: str, head_dim: int | None = None, quantization: str | None = None) -> dict[str, Any]:
    """What every implementation's ``supports()`` is asked when an engine selects its op table
    (and ``fd doctor`` and the conformance kit, so they show the engine's choice): the model's
    dtype, head size (none: any) and weight quantization."""
    context: dict[str, Any] = {"dtype": dtype, "quantization": quantization}
    if head_dim is not None:
        context["head_dim"] = head_dim
    return context


@dataclass(frozen=True)
class OpImpl:
    op: str
    device_type: str
    name: str
    fn: Callable[..., Any]
    priority: int = 0
    supports: Supports = _always
    source: str = ""  # the package that registered it
    runtime: str | None = None  # the runtime whose tensors ``fn`` takes; None: any runtime
    api: str = API_VERSION  # the contract version its package declares (fd-core's own: this one)

    def accepts(self, context: Mapping[str, Any]) -> tuple[bool, str]:
        try:
            ok = bool(self.supports(**context))
        except Exception as exc:  # a buggy predicate must not take start-up down
            return False, f"supports() raised {type(exc).__name__}: {exc}"
        if ok:
            return True, ""
        why = "supports() declined this configuration"
        # optional: a predicate may carry ``why(**context)``, one sentence saying why it declines
        explain = getattr(self.supports, "why", None)
        if callable(explain):
            try:
                detail = str(explain(**context) or "")
            except Exception:  # noqa: BLE001 - the reason is a report; the decision stands
                detail = ""
            if detail:
                why += f": {detail}"
        return False, why


@dataclass(frozen=True)
class Choice:
    op: str
    impl: OpImpl
    reason: str


class OpRegistry:
    """Every implementation any plugin registered, keyed by ``(op, device_type)``; each may be
    tied to one runtime (the tensor library whose tensors it takes), and is then a candidate
    only when the engine runs on that runtime.

    A runtime's reference ops are kept apart, keyed by runtime name: they are the fallback for
    any device that runtime can address. A backend whose own implementation on some runtime
    *is* that runtime's reference says so with ``use_reference``, so it is chosen like a
    registered op (no fallback warning) without importing the runtime at registration.
    """

    def __init__(self) -> None:
        self._impls: dict[tuple[str, str], list[OpImpl]] = {}
        self._references: dict[str, dict[str, Callable[..., Any]]] = {}
        # (device_type, runtime) -> (name, priority, source) of an adopted reference table
        self._adopted: dict[tuple[str, str], tuple[str, int, str]] = {}
        self._current_source = ""
        self._current_api = API_VERSION

    @contextmanager
    def registering(self, source: str, api: str = API_VERSION) -> Iterator[None]:
        """One package's registration: what it registers is attributed to ``source``, written
        against contract ``api`` (its ``FD_API_VERSION``), and if it raises part way, everything
        it registered is withdrawn, so a failed backend leaves no half of its op table behind."""
        impls = {key: list(found) for key, found in self._impls.items()}
        adopted = dict(self._adopted)
        self._current_source, self._current_api = source, api
        try:
            yield
        except BaseException:
            self._impls, self._adopted = impls, adopted
            raise
        finally:
            self._current_source, self._current_api = "", API_VERSION

    def register(
        self,
        op: str,
        device_type: str,
        fn: Callable[..., Any],
        *,
        name: str,
        priority: int = 0,
        supports: Supports | None = None,
        runtime: str | None = None,
    ) -> None:
        """Register ``fn`` for ``op`` on ``device_type``. ``runtime`` (API 1.2) names the
        runtime whose tensors ``fn`` takes (``"paddle"``, ``"torch"``); it is then chosen only
        when the engine runs on that runtime. None: any runtime the device type runs on."""
        if op not in OP_SPECS:
            raise ValueError(f"unknown op {op!r}; the contract defines {sorted(OP_SPECS)}")
        wrong = mismatch(op, fn)
        if wrong:
            raise TypeError(f"{self._current_source or 'a plugin'} registers {name!r} for {op} on {device_type}, "
                            f"but it {wrong}; the contract is {OP_SPECS[op].signature}")
        impl = OpImpl(op, device_type, name, fn, priority, supports or _always, self._current_source, runtime,
                      self._current_api)
        self._impls.setdefault((op, device_type), []).append(impl)

    def use_reference(self, device_type: str, runtime: str, *, name: str = "reference", priority: int = 0) -> None:
        """Declare ``runtime``'s reference ops the registering package's own implementation of
        every op on ``device_type`` under that runtime (API 1.2): they are chosen like ops
        registered at ``priority`` (no fallback warning, ``fd doctor`` names the package), and
        the runtime is imported only when an engine selects it."""
        self._adopted[(device_type, runtime)] = (name, priority, self._current_source)

    def register_reference(self, runtime: str, table: Mapping[str, Callable[..., Any]]) -> None:
        unknown = set(table) - set(OP_SPECS)
        if unknown:
            raise ValueError(f"unknown ops in the {runtime} reference table: {sorted(unknown)}")
        wrong = {op: why for op, fn in table.items() if (why := mismatch(op, fn))}
        if wrong:
            raise TypeError(f"the {runtime} reference table's ops differ from the contract: {wrong}")
        self._references[runtime] = dict(table)

    def implementations(self, op: str, device_type: str, runtime: str | None = None) -> list[OpImpl]:
        """Highest priority first; with ``runtime``, only those usable on it."""
        impls = self._impls.get((op, device_type), [])
        if runtime is not None:
            impls = [i for i in impls if i.runtime in (None, runtime)]
        return sorted(impls, key=lambda i: -i.priority)

    def select(
        self,
        device_type: str,
        runtime: str,
        context: Mapping[str, Any] | None = None,
        pins: Mapping[str, str] | None = None,
        methods: Iterable[str] = (),
    ) -> "OpTable":
        """Choose one implementation per op among those usable on ``runtime``: the pinned one,
        else the highest-priority one whose ``supports(**context)`` accepts, else the
        runtime's reference (with a warning). ``linear`` and ``pack_linear`` are chosen again
        for each quantization method in ``methods`` (``supports(quantization=method)``), so that
        each method's weights go to the implementation that serves it."""
        context = dict(context or {})
        pins = dict(pins or {})
        unknown = set(pins) - set(OP_SPECS)
        if unknown:
            raise ConfigError(f"--op names unknown ops {sorted(unknown)}; known: {sorted(OP_SPECS)}")
        choices: dict[str, Choice] = {}
        for op in OP_SPECS:
            if op in ("pack_linear", "pack_experts"):
                continue  # pack_linear only per method; pack_experts goes with the moe chosen
            choice = self._choose(op, device_type, runtime, context, pins)
            if choice is not None:
                choices[op] = choice
        for fused, parts in FUSED_OPS.items():
            choice = choices.get(fused)
            if choice is None or fused in pins:
                continue
            elsewhere = [p for p in parts if p not in choices or choices[p].impl.source != choice.impl.source]
            if elsewhere:  # e.g. --op attention=reference: the parts run, as asked
                log.info("op %s (%s) not used: %s chosen from another package", fused, choice.impl.name,
                         ", ".join(elsewhere))
                del choices[fused]
        if "moe" in choices:
            # the moe chosen reads only what its own pack_experts makes, or the lists
            moe = choices["moe"].impl
            paired = [i for i in self.implementations("pack_experts", device_type, runtime) if i.name == moe.name]
            if paired:
                choices["pack_experts"] = Choice("pack_experts", paired[0], f"paired with moe ({moe.name})")
        per_method: dict[str, dict[str, Choice]] = {}
        for method in sorted(set(methods)):
            picked = {}
            for op in QUANTIZED_OPS:
                wanted = dict(pins)
                if op == "pack_linear" and "linear" in pins and "pack_linear" not in pins:
                    # a pinned linear reads only what its own pack_linear makes, or the canonical form
                    if not any(i.name == pins["linear"] for i in self.implementations(op, device_type, runtime)):
                        continue
                    wanted["pack_linear"] = pins["linear"]
                choice = self._choose(op, device_type, runtime, {**context, "quantization": method}, wanted)
                if choice is not None:
                    picked[op] = choice
            per_method[method] = picked
        return OpTable(device_type, runtime, choices, per_method)

    def _choose(self, op: str, device_type: str, runtime: str, context: Mapping[str, Any],
                pins: Mapping[str, str]) -> Choice | None:
        reference = self._references.get(runtime, {})
        adopted = self._adopted.get((device_type, runtime))
        candidates = self.implementations(op, device_type, runtime)
        if adopted is not None and op in reference:
            name, priority, source = adopted
            candidates = sorted(
                candidates + [OpImpl(op, device_type, name, reference[op], priority, _always, source, runtime)],
                key=lambda i: -i.priority,
            )
        ref_impl = (
            OpImpl(op, device_type, "reference", reference[op], -(10**9), _always, runtime, runtime)
            if op in reference
            else None
        )
        if op in pins:
            wanted = pins[op]
            pool = candidates + ([ref_impl] if ref_impl else [])
            match = [c for c in pool if c.name == wanted]
            if not match:
                names = sorted({c.name for c in pool})
                raise ConfigError(
                    f"--op {op}={wanted}: no implementation named {wanted!r} for device "
                    f"type {device_type!r} on the {runtime} runtime; available: {names}"
                )
            return Choice(op, match[0], "pinned by the user")
        declined = []
        for impl in candidates:
            ok, why = impl.accepts(context)
            if ok:
                tied = f", for the {impl.runtime} runtime" if impl.runtime else ""
                passed = f"; declined: {'; '.join(declined)}" if declined else ""
                return Choice(op, impl, f"priority {impl.priority}, supports this config{tied}{passed}")
            declined.append(f"{impl.name}: {why}")
        if ref_impl is None:
            return None  # reported by OpTable.missing(); only fatal if a model calls it
        reason = "no implementation registered for this device type"
        if declined:
            reason = "every registered implementation declined (" + "; ".join(declined) + ")"
        method = context.get("quantization")
        label = f"{op}[{method}]" if method and op in QUANTIZED_OPS else op
        log.warning("op %s on %s: falling back to the %s reference: %s", label, device_type, runtime, reason)
        return Choice(op, ref_impl, f"fallback to the {runtime} reference: {reason}")


@dataclass
class OpTable:
    """The ops a model calls: ``ops.linear(x, w)``. Chosen once; never re-decided per call.

    ``per_method`` holds, for each quantization method the model's weights use, the ``linear``
    (and ``pack_linear``) chosen for it; ``ops.linear`` hands a QuantizedWeight to its method's."""

    device_type: str
    runtime: str
    choices: dict[str, Choice] = field(default_factory=dict)
    per_method: dict[str, dict[str, Choice]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op, choice in self.choices.items():
            if op != "pack_experts":  # a method, identity where none was chosen
                setattr(self, op, choice.impl.fn)
        plain = self.choices.get("linear")
        by_method = {m: c["linear"].impl.fn for m, c in self.per_method.items() if "linear" in c}
        if plain is not None and any(fn is not plain.impl.fn for fn in by_method.values()):
            self.linear = _dispatch_linear(plain.impl.fn, by_method)

    def pack_linear(self, weight: QuantizedWeight) -> QuantizedWeight:
        """The form the chosen ``linear`` for ``weight.method`` reads (the weight itself where that
        implementation packs nothing)."""
        choice = self.per_method.get(weight.method, {}).get("pack_linear")
        return weight if choice is None else choice.impl.fn(weight)

    def pack_experts(self, gate_up: list[Any], down: list[Any]) -> tuple[Any, Any]:
        """A sparse layer's experts in the form the chosen ``moe`` reads (the lists themselves
        where that implementation packs nothing)."""
        choice = self.choices.get("pack_experts")
        return (gate_up, down) if choice is None else choice.impl.fn(gate_up, down)

    def has(self, op: str) -> bool:
        return op in self.choices

    def lacks(self, op: str, since: str) -> str:
        """Why the chosen ``op`` cannot do what contract ``since`` added to it ("" if it can):
        an implementation from a package written against an older contract knows nothing of
        it (e.g. ``sample`` and structured output's bitmask, 1.10). A runtime's reference ops,
        adopted or not, are fd-core's and always current."""
        choice = self.choices.get(op)
        if choice is None or at_least(choice.impl.api, since):
            return ""
        return (f"its {op} op ({choice.impl.name}, from {choice.impl.source}) was written for plugin API "
                f"{choice.impl.api}, before {since}")

    def missing(self) -> list[str]:
        """Ops a model may need that nothing implements (optional ops are not counted)."""
        return [op for op, spec in OP_SPECS.items() if op not in self.choices and not spec.optional]

    def describe(self) -> list[tuple[str, str, str, str]]:
        """``(op, implementation, registered by, why)`` rows, for ``fd doctor`` and logs."""
        rows = [(op, c.impl.name, c.impl.source, c.reason) for op, c in self.choices.items() if op != "pack_linear"]
        rows += [(f"{op}[{method}]", c.impl.name, c.impl.source, c.reason)
                 for method, picked in self.per_method.items() for op, c in picked.items()]
        rows += [(op, "-", "-", "missing") for op in self.missing()]
        chosen = set(self.choices) | {op for picked in self.per_method.values() for op in picked}
        rows += [(op, "-", "-", "optional, not provided") for op, spec in OP_SPECS.items()
                 if spec.optional and op not in chosen]
        return rows


def _dispatch_linear(plain: Callable[..., Any], by_method: Mapping[str, Callable[..., Any]]) -> Callable[..., Any]:
    def linear(x: Any, weight: Any, bias: Any = None) -> Any:
        if isinstance(weight, QuantizedWeight):
            return by_method.get(weight.method, plain)(x, weight, bias)
        return plain(x, weight, bias)

    return linear
