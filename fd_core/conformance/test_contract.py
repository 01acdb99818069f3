"""Discovery, the API version, the platform's answers, and the capability manifest: every
declared capability is backed by what the backend provides, every undeclared one is refused
at start-up with one sentence naming the flag and the backend."""

from __future__ import annotations

import dataclasses

import pytest

from fd_core.engine.config import EngineConfig
from fd_core.errors import ConfigError
from fd_core.interfaces import (
    API_VERSION,
    OP_SPECS,
    QUANTIZATION_METHODS,
    Capabilities,
    Platform,
    is_compatible,
)
from fd_core.plugins.ops import op_context
from fd_core.quantization.kv_cache import KV_QUANTIZED
from fd_core.plugins.registry import platform_runtimes, runtime_installed

# What the contract's words mean today; a manifest naming anything else is a typo or a promise
# no engine code keeps.
KNOWN_DTYPES = {"float32", "float16", "bfloat16"}
KNOWN_QUANTIZATION = set(QUANTIZATION_METHODS)


def _platform(fd_backend):
    if fd_backend.platform is None:
        pytest.fail(fd_backend.reason)
    return fd_backend.platform


def test_backend_is_discovered_through_its_entry_point(fd_backend):
    record = fd_backend.record
    assert record is not None, fd_backend.reason
    assert record.loaded, f"{record.name} ({record.package}) failed to load: {record.error}"
    declared = getattr(record.module, "FD_API_VERSION", None)
    assert declared is not None, f"{record.package} does not declare FD_API_VERSION"
    ok, why = is_compatible(str(declared), API_VERSION)
    assert ok, why
    names = [p.name for p in fd_backend.registry.platforms()]
    assert names.count(fd_backend.device) == 1, f"{names.count(fd_backend.device)} platforms are named {fd_backend.device}"


def test_platform_answers(fd_backend):
    p = _platform(fd_backend)
    assert isinstance(p, Platform), "the platform lacks methods of fd_core.interfaces.Platform"
    for attr in ("name", "device_type", "runtime"):
        value = getattr(p, attr)
        assert isinstance(value, str) and value, f"Platform.{attr} must be a non-empty string, got {value!r}"
    answer = p.is_available()
    assert isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool) and isinstance(answer[1], str), (
        f"is_available() must return (bool, str), got {answer!r}")
    ok, why = answer
    if not ok:  # the sentence `fd serve --device NAME` prints
        assert why.strip() and "\n" not in why and len(why) <= 300, f"the unavailable reason must be one sentence: {why!r}"
    count = p.device_count()
    assert isinstance(count, int) and count >= (1 if ok else 0), f"device_count() = {count!r}"
    default = getattr(p, "default_max_num_batched_tokens", None)
    assert default is None or (isinstance(default, int) and default > 0), default
    # optional (API 1.4); None or 0: no cap
    threshold = getattr(p, "default_long_prefill_token_threshold", None)
    assert threshold is None or (isinstance(threshold, int) and not isinstance(threshold, bool) and threshold >= 0), (
        f"default_long_prefill_token_threshold must be None or an integer >= 0, got {threshold!r}")


def test_capabilities_are_an_honest_manifest(fd_backend):
    p = _platform(fd_backend)
    caps = p.capabilities()
    assert isinstance(caps, Capabilities), f"capabilities() returned {type(caps).__name__}"
    assert caps == p.capabilities(), "capabilities() must not change between calls"
    with pytest.raises(dataclasses.FrozenInstanceError):
        caps.graph_capture = not caps.graph_capture  # type: ignore[misc]
    assert caps.dtypes and caps.dtypes <= KNOWN_DTYPES, f"dtypes {sorted(caps.dtypes)}; known {sorted(KNOWN_DTYPES)}"
    assert caps.kv_cache_dtypes <= KNOWN_DTYPES | KV_QUANTIZED.keys(), sorted(caps.kv_cache_dtypes)
    assert caps.dtypes & caps.kv_cache_dtypes, "no dtype is both a compute and a KV-cache dtype"
    assert caps.quantization <= KNOWN_QUANTIZATION, sorted(caps.quantization)
    assert caps.quantized_lm_head <= caps.quantization, (
        f"quantized_lm_head {sorted(caps.quantized_lm_head)} names methods outside quantization "
        f"{sorted(caps.quantization)}")
    if fd_backend.available:
        assert caps.device_count == p.device_count(), (
            f"Capabilities.device_count {caps.device_count} != device_count() {p.device_count()}")
    if caps.device_count > 1:
        assert caps.collective_library != "none", "several devices but no collective library"
    hooks = p.runner_hooks()
    if caps.graph_capture:
        assert hooks is not None and callable(getattr(hooks, "wrap_forward", None)), (
            "graph_capture is declared but runner_hooks() provides no wrap_forward")


def _refusals(caps: Capabilities) -> list[tuple[str, dict]]:
    """(flag, EngineConfig fields) for each feature the manifest does not declare."""
    out = [(f"--dtype {d}", {"dtype": d}) for d in sorted(KNOWN_DTYPES - caps.dtypes)]
    out += [(f"--quantization {q}", {"quantization": q}) for q in sorted(KNOWN_QUANTIZATION - caps.quantization)]
    out += [(f"--kv-cache-dtype {kv}", {"kv_cache_dtype": kv}) for kv in sorted(KV_QUANTIZED.keys() - caps.kv_cache_dtypes)]
    if not caps.chunked_prefill:
        out.append(("--enable-chunked-prefill", {"enable_chunked_prefill": True}))
    if not caps.prefix_caching:
        out.append(("--enable-prefix-caching", {"enable_prefix_caching": True}))
    if not caps.kv_swap:
        out.append(("--swap-space", {"swap_space": 1.0}))
    if not caps.memory_profiling:
        out.append(("--gpu-memory-utilization", {"gpu_memory_utilization": 0.5}))
    out.append((f"--tensor-parallel-size {caps.device_count + 1}", {"tensor_parallel_size": caps.device_count + 1}))
    return out


def test_undeclared_features_are_refused_in_one_sentence(fd_backend):
    fd_backend.require()  # without a device, every start-up is refused for that reason first
    p = fd_backend.platform
    caps = p.capabilities()
    for flag, fields in _refusals(caps):
        config = EngineConfig(model="unused", device=p.name, **fields)
        with pytest.raises(ConfigError) as err:
            config.check_against(p.name, caps)
        message = str(err.value)
        assert message.startswith(flag.split()[0]) and p.name in message and "\n" not in message, (
            f"{flag}: the refusal should name the flag and the backend in one sentence, got {message!r}")


def test_refusal_comes_before_anything_loads(fd_backend, tmp_path):
    """An undeclared dtype stops the engine before the model is even looked for."""
    fd_backend.require()
    caps = fd_backend.capabilities
    missing = sorted(KNOWN_DTYPES - caps.dtypes)
    if not missing:
        pytest.skip("the backend declares every known dtype")
    from fd_core import LLM

    with pytest.raises(ConfigError, match=f"--dtype {missing[0]}"):
        LLM(str(tmp_path / "no-such-model"), device=fd_backend.device, runtime=fd_backend.runtime, dtype=missing[0])


def test_op_table_is_complete_for_every_declared_dtype(fd_backend):
    p = _platform(fd_backend)
    caps = p.capabilities()
    for dtype in sorted(caps.dtypes):
        for head_dim in (64, 128):
            table = fd_backend.registry.op_table(p, op_context(dtype, head_dim))
            assert not table.missing(), f"{dtype}, head_dim {head_dim}: no implementation of {table.missing()}"
    for op in OP_SPECS:  # a predicate that raises is reported by accepts(); it must not
        for impl in fd_backend.registry.ops.implementations(op, p.device_type, p.runtime):
            for dtype in sorted(caps.dtypes):
                for quantization in [None, *sorted(caps.quantization)]:
                    ok, why = impl.accepts(op_context(dtype, 64, quantization))
                    assert "raised" not in why, f"{op} implementation {impl.name!r} ({impl.source}): {why}"


def test_every_listed_runtime_binds(fd_backend):
    p = _platform(fd_backend)
    for runtime in platform_runtimes(p):
        if not runtime_installed(runtime):
            continue
        bound = p if runtime == p.runtime else p.with_runtime(runtime)  # type: ignore[attr-defined]
        assert bound.runtime == runtime and bound.name == p.name
        assert isinstance(bound.capabilities(), Capabilities)


def test_single_rank_communicator_is_the_identity(fd_backend):
    fd_backend.require()
    import numpy as np

    comm = fd_backend.platform.communicator(0, 1)
    memory = fd_backend.memory()
    x = memory.from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert (comm.rank, comm.world_size) == (0, 1)
    np.testing.assert_array_equal(memory.to_numpy(comm.all_reduce(x)), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(memory.to_numpy(comm.all_gather(x, axis=-1)), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(memory.to_numpy(comm.broadcast(x, src=0)), np.arange(6).reshape(2, 3))
