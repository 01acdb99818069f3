"""An op implementation's parameters against the contract's signature, checked at registration.

Without it a backend whose ``rms_norm`` forgot ``residual`` passes ``fd backends`` and
``fd doctor`` and fails inside the first step with a raw traceback. The engine passes each op's
parameters in the contract's order, the required ones by position and the defaulted ones by
position or by name, so an implementation must accept parameter ``i`` at position ``i`` (or
``*args``), accept each defaulted one by its contract name (or ``**kwargs``), and require
nothing the contract does not pass. Names of required parameters are free.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from fd_core.interfaces import OP_SPECS


def contract_parameters(op: str) -> list[tuple[str, bool]]:
    """``[(name, has_default)]`` of ``op``'s contract signature (``OP_SPECS[op].signature``)."""
    text = OP_SPECS[op].signature
    params, current, depth = [], "", 0
    for ch in text[text.index("(") + 1 :]:  # up to the parenthesis that closes the parameters
        if ch in "[(":
            depth += 1
        elif ch in "])":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            params.append(current)
            current = ""
        else:
            current += ch
    if current.strip():
        params.append(current)
    return [(p.split(":")[0].strip(), "=" in p) for p in params]


def mismatch(op: str, fn: Callable[..., Any]) -> str:
    """Why ``fn`` cannot be called as ``op`` is called, or "" (also where Python cannot tell
    its signature, e.g. a builtin)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return ""
    kinds = inspect.Parameter
    positional = [p for p in sig.parameters.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name for p in sig.parameters.values() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    var_pos = any(p.kind == kinds.VAR_POSITIONAL for p in sig.parameters.values())
    var_kw = any(p.kind == kinds.VAR_KEYWORD for p in sig.parameters.values())
    wanted = contract_parameters(op)
    problems = []
    for i, (name, optional) in enumerate(wanted):
        if i >= len(positional) and not var_pos:
            problems.append(f"takes no parameter {i + 1} ({name})")
        elif optional and not var_kw and name not in by_name:
            problems.append(f"does not take {name}= by name")
    extra = [p.name for p in positional[len(wanted):] if p.default is p.empty]
    extra += [p.name for p in sig.parameters.values() if p.kind == kinds.KEYWORD_ONLY and p.default is p.empty
              and p.name not in {n for n, _ in wanted}]
    if extra:
        problems.append(f"requires {', '.join(extra)}, which the engine never passes")
    return "; ".join(problems)
