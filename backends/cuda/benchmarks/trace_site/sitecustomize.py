"""Tracing for ``serve_latency.py --trace DIR``: put on PYTHONPATH of ``fd serve`` and every process
it starts. Each process records its garbage collections after start-up (the heap frozen by
``fd_core.heap``); the engine core also records every step: when it began, how long
``EngineCore.step`` took, how many tokens and sequences the scheduler gave it, and how many
cudaMalloc calls, allocator retries (torch's caching allocator) and pinned host allocations it
made; and every Triton
compilation (a kernel's first launch with a new specialisation) with its time. Written to
DIR/trace.<pid>.jsonl, appended every half second by a thread (processes may end by a signal)."""

import gc
import json
import os
import sys
import threading
import time

_DIR = os.environ.get("FD_TRACE_DIR")
_start = {}
_gc: list = []  # (start, seconds, generation) after the freeze
_steps: list = []  # (start, seconds, tokens, sequences)


def _writer() -> None:
    # appends only what is new, as JSON lines: rewriting the whole trace held the GIL for ever
    # longer, which is the kind of gap this traces
    path = os.path.join(_DIR, f"trace.{os.getpid()}.jsonl")
    done = {"gc": 0, "steps": 0, "compiles": 0}
    with open(path, "a") as f:
        f.write(json.dumps({"argv": sys.argv[:3]}) + "\n")
        while True:
            time.sleep(0.5)
            for kind, rows in (("gc", _gc), ("steps", _steps), ("compiles", _compiles)):
                new = rows[done[kind]:]
                done[kind] += len(new)
                for row in new:
                    f.write(json.dumps([kind, *row]) + "\n")
            f.flush()


def _on_gc(phase, info):
    now = time.perf_counter()
    if phase == "start":
        _start["gc"] = now
    elif gc.get_freeze_count():
        _gc.append((_start.get("gc", now), now - _start.get("gc", now), info["generation"]))


_compiles: list = []  # (time, kernel) of every Triton compilation: a first launch of a specialisation


def _count_compiles() -> None:
    from triton import knobs

    before = knobs.runtime.jit_cache_hook

    def hook(**kwargs):
        _compiles.append((time.perf_counter(), getattr(kwargs.get("fn"), "name", "?")))
        return before(**kwargs) if before else False  # False: compile it

    knobs.runtime.jit_cache_hook = hook


def _wrap_core() -> None:
    from fd_core.engine import core, scheduler

    schedule, step = scheduler.Scheduler.schedule, core.EngineCore.step
    last = {}

    def traced_schedule(self):
        out = schedule(self)
        last["tokens"], last["seqs"] = out.num_tokens, len(out.scheduled)
        return out

    def allocator():
        """cudaMalloc calls, the allocator's free-everything-and-retry, and cudaHostAlloc calls
        of the pinned-memory cache (each may synchronise with the device), so far."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_initialized():
            return 0, 0, 0
        stats = torch.cuda.memory_stats()
        try:
            host = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        except (AttributeError, RuntimeError):
            host = 0
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0), host

    def traced_step(self):
        began = time.perf_counter()
        last.clear()
        before = allocator()
        result = step(self)
        seconds = time.perf_counter() - began
        after = allocator()
        _steps.append((began, seconds, last.get("tokens", 0), last.get("seqs", 0),
                       *(b - a for a, b in zip(before, after))))
        return result

    scheduler.Scheduler.schedule, core.EngineCore.step = traced_schedule, traced_step


if _DIR:
    gc.callbacks.append(_on_gc)
    threading.Thread(target=_writer, daemon=True).start()
    for hook in (_wrap_core, _count_compiles):
        try:
            hook()
        except Exception:  # noqa: BLE001 - a process without fd_core's engine or Triton: less traced
            pass
