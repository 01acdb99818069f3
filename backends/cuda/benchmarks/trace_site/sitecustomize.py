"""Tracing for ``serve_latency.py --trace DIR``: put on PYTHONPATH of ``fd serve`` and every process
it starts. Each process records its garbage collections after start-up (the heap frozen by
``fd_core.heap``); the engine core also records every step: when it began, how long
``EngineCore.step`` took, how many tokens and sequences the scheduler gave it, and how many
cudaMalloc calls, allocator retries (torch's caching allocator) and pinned host allocations it
made, and where its time went (the scheduler, queuing the step on the device, reading the
previous step's tokens, and within that the wait for the device), and the CPU the step's
thread and the whole process used meanwhile with the thread's involuntary context switches
(a thread that used far less CPU than its wall time, without waiting for the device, was
descheduled or waited for the GIL; but a launch that waits for room in the device's queue
spins, so busy CPU does not by itself mean host-bound), and how far the device lagged behind
the host when the step began and when it had queued its work (CUDA events timed against one
reference event taken with the device idle: a lag that grows through a step means the device
was the slower side, one near zero at its end that the device waited for the host); and every
Triton
compilation (a kernel's first launch with a new specialisation) with its time. Written to
DIR/trace.<pid>.jsonl, appended every half second by a thread (processes may end by a signal)."""

import gc
import json
import os
import resource
import sys
import threading
import time

_DIR = os.environ.get("FD_TRACE_DIR")
_start = {}
_gc: list = []  # (start, seconds, generation) after the freeze
_steps: list = []  # (start, seconds, tokens, sequences)
_devices: list = []  # (start, lag at its start, lag at its end) of steps, seconds, once completed
_pending: list = []  # (start, host time at each record, the events) not yet completed
_reference: list = []  # an event completed with the device idle, and the host's time then


def _writer() -> None:
    # appends only what is new, as JSON lines: rewriting the whole trace held the GIL for ever
    # longer, which is the kind of gap this traces
    path = os.path.join(_DIR, f"trace.{os.getpid()}.jsonl")
    done = {"gc": 0, "steps": 0, "compiles": 0, "devices": 0}
    with open(path, "a") as f:
        f.write(json.dumps({"argv": sys.argv[:3]}) + "\n")
        while True:
            time.sleep(0.5)
            while _pending and _pending[0][4].query():  # the events complete in order
                began, at_start, at_end, start, end = _pending.pop(0)
                ref, ref_host = _reference
                _devices.append((began, ref.elapsed_time(start) / 1000 + ref_host - at_start,
                                 ref.elapsed_time(end) / 1000 + ref_host - at_end))
            for kind, rows in (("gc", _gc), ("steps", _steps), ("compiles", _compiles), ("devices", _devices)):
                new = rows[done[kind]:]
                done[kind] += len(new)
                for row in new:
                    f.write(json.dumps([kind, *row]) + "\n")
            f.flush()


_frozen = [False]


def _on_gc(phase, info):
    now = time.perf_counter()
    if phase == "start":
        _start["gc"] = now
        return
    if not _frozen[0]:
        # asked until the heap is frozen, then never again: get_freeze_count walks the frozen
        # objects (25 ms a call in the engine core, H200 host), which made this callback the
        # slowest part of the steps it was meant to observe
        _frozen[0] = gc.get_freeze_count() > 0
    if _frozen[0]:
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

    from fd_core.engine import executor

    schedule, step = scheduler.Scheduler.schedule, core.EngineCore.step
    last = {}
    phases: dict = {}

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - began
        return wrapper

    def traced_schedule(self):
        began = time.perf_counter()
        out = schedule(self)
        phases["schedule"] = time.perf_counter() - began
        last["tokens"], last["seqs"] = out.num_tokens, len(out.scheduled)
        return out

    executor.Executor.launch = timed("launch", executor.Executor.launch)
    core.EngineCore._read = timed("read", core.EngineCore._read)
    try:
        from fd_backend_cuda.kernels import sampling
        sampling.DeviceSample.result = timed("wait", sampling.DeviceSample.result)
    except Exception:  # noqa: BLE001 - no cuda backend here
        pass

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

    # FD_TRACE_PROFILE=1: cProfile the steps that begin with prompts waiting (the ones that
    # admit new prompts: prefill and mixed steps), their statistics written to
    # DIR/profile.<pid>.txt every 25 such steps
    threshold = os.environ.get("FD_TRACE_PROFILE") == "1"
    profiler = None
    if threshold:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiled = [0]

        def dump():
            with open(os.path.join(_DIR, f"profile.{os.getpid()}.txt"), "w") as f:
                f.write(f"{profiled[0]} steps that began with prompts waiting\n")
                pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(30)

    def traced_step(self):
        if profiler is not None and self.scheduler.waiting:
            profiler.enable()
            try:
                return timed_step(self)
            finally:
                profiler.disable()
                profiled[0] += 1
                if profiled[0] % 25 == 0:
                    dump()
        return timed_step(self)

    def timed_step(self):
        began = time.perf_counter()
        last.clear()
        phases.clear()
        before = allocator()
        usage, process = resource.getrusage(resource.RUSAGE_THREAD), time.process_time()
        torch = sys.modules.get("torch")
        events = None
        if torch is not None and torch.cuda.is_initialized():
            if not _reference:
                ref = torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                ref.record()
                ref.synchronize()
                _reference.extend((ref, time.perf_counter()))
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            at_start = time.perf_counter()
            events[0].record()
        result = step(self)
        seconds = time.perf_counter() - began
        if events is not None:
            at_end = time.perf_counter()
            events[1].record()
            _pending.append((began, at_start, at_end, *events))
        now = resource.getrusage(resource.RUSAGE_THREAD)
        phases["cpu"] = now.ru_utime + now.ru_stime - usage.ru_utime - usage.ru_stime
        phases["process_cpu"] = time.process_time() - process
        phases["switches"] = now.ru_nivcsw - usage.ru_nivcsw
        after = allocator()
        _steps.append((began, seconds, last.get("tokens", 0), last.get("seqs", 0),
                       *(b - a for a, b in zip(before, after)), dict(phases)))
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
