"""Memory: transfers in every declared dtype, the KV cache in the contract's layout, block
copies, swap where ``kv_swap`` is declared, and the memory queries the manifest promises."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.quantization.kv_cache import KV_QUANTIZED, cache_layout

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 2, 6, 4, 2, 8
SLOTS = BLOCKS * BLOCK_SIZE


def _rounded(array: np.ndarray, dtype: str) -> np.ndarray:
    """``array`` as ``dtype`` stores it, in float32 (round to nearest even)."""
    if dtype == "float16":
        return array.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = array.astype(np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    return array.astype(np.float32)


def test_transfers_round_trip_in_every_declared_dtype(fd_backend):
    memory = fd_backend.memory()
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    for dtype in sorted(fd_backend.capabilities.dtypes):
        back = np.asarray(memory.to_numpy(memory.from_numpy(x, dtype)))
        assert back.shape == x.shape, f"{dtype}: shape {back.shape}"
        np.testing.assert_array_equal(back.astype(np.float32), _rounded(x, dtype),
                                      err_msg=f"from_numpy(x, {dtype!r}) then to_numpy")
    ids = np.arange(7, dtype=np.int64)
    np.testing.assert_array_equal(memory.to_numpy(memory.from_numpy(ids)), ids, err_msg="int64 round trip")


def test_bits_are_the_stored_values_where_the_memory_has_them(fd_backend):
    """Optional (1.15): to_numpy_bits gives each element's stored bits as an unsigned integer of
    its width, and from_numpy_bits makes the same values of them, in every declared dtype."""
    memory = fd_backend.memory()
    if not hasattr(memory, "to_numpy_bits"):
        pytest.skip("the Memory has no to_numpy_bits (optional: fd-core converts on the host)")
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    for dtype in sorted(fd_backend.capabilities.dtypes):
        tensor = memory.from_numpy(x, dtype)
        bits = np.asarray(memory.to_numpy_bits(tensor))
        width = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
        assert bits.dtype == np.dtype(f"u{width}") and bits.shape == x.shape, f"{dtype}: {bits.dtype} {bits.shape}"
        if dtype == "bfloat16":
            expected = _rounded(x, dtype).view(np.uint32) >> 16
        else:
            expected = x.astype(dtype).view(f"u{width}")
        np.testing.assert_array_equal(bits, expected.astype(bits.dtype), err_msg=f"to_numpy_bits in {dtype}")
        back = np.asarray(memory.to_numpy(memory.from_numpy_bits(bits, dtype))).astype(np.float32)
        np.testing.assert_array_equal(back, _rounded(x, dtype), err_msg=f"from_numpy_bits in {dtype}")


def _kv(memory, dtype: str):
    caches = memory.allocate_kv_cache(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype)
    assert len(caches) == LAYERS and all(len(pair) == 2 for pair in caches), "one (key, value) pair per layer"
    return caches


def test_kv_cache_layout_and_zero_fill(fd_backend):
    memory = fd_backend.memory()
    for dtype in sorted(fd_backend.capabilities.kv_cache_dtypes & fd_backend.capabilities.dtypes):
        for key, value in _kv(memory, dtype):
            for t in (key, value):
                host = np.asarray(memory.to_numpy(t))
                assert host.shape == (SLOTS, KV_HEADS, HEAD_DIM), (
                    f"{dtype} cache shape {host.shape}, the contract's layout is "
                    f"[num_blocks * block_size, num_kv_heads, head_dim] = {[SLOTS, KV_HEADS, HEAD_DIM]}")
                assert not host.any(), "allocate_kv_cache must zero-fill"
    # a declared int8 / fp8_e4m3 cache: per block a plane of values and one of float16 scales,
    # in the storage dtype that names the format (fd_core.quantization.kv_cache)
    for kv in sorted(fd_backend.capabilities.kv_cache_dtypes & KV_QUANTIZED.keys()):
        row, storage = cache_layout(kv, HEAD_DIM)
        for key, value in _kv(memory, kv):
            for t in (key, value):
                host = np.asarray(memory.to_numpy(t))
                assert host.shape == (SLOTS, KV_HEADS, row) and host.dtype == np.dtype(storage), (
                    f"{kv} cache: {host.dtype} {host.shape}, the format is {storage} "
                    f"{[SLOTS, KV_HEADS, row]} (each block: a plane of values, then one of float16 scales)")
                assert not host.any(), "allocate_kv_cache must zero-fill"


def _filled(memory, dtype: str, seed: int):
    """A cache whose every slot holds distinct values, and those values on the host."""
    rng = np.random.default_rng(seed)
    host = [tuple(rng.standard_normal((SLOTS, KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
            for _ in range(LAYERS)]
    return [tuple(memory.from_numpy(a, dtype) for a in pair) for pair in host], host


def _blocks(array: np.ndarray, block: int) -> np.ndarray:
    return array[block * BLOCK_SIZE:(block + 1) * BLOCK_SIZE]


def test_copy_blocks_copies_whole_blocks_in_every_layer(fd_backend):
    memory = fd_backend.memory()
    caches, _ = _filled(memory, fd_backend.dtype, 1)
    host = [tuple(np.asarray(memory.to_numpy(t)) for t in pair) for pair in caches]  # as stored
    moves = [(0, 3), (2, 5), (3, 1)]  # block 3 is both a destination and a source: read first
    memory.copy_blocks(caches, BLOCK_SIZE, moves)
    for layer, (pair, before) in enumerate(zip(caches, host)):
        for t, old in zip(pair, before):
            now = np.asarray(memory.to_numpy(t))
            for src, dst in moves:
                np.testing.assert_array_equal(_blocks(now, dst), _blocks(old, src),
                                              err_msg=f"layer {layer}: block {src} -> {dst}")
            for untouched in (0, 2, 4):
                np.testing.assert_array_equal(_blocks(now, untouched), _blocks(old, untouched))


def test_swap_out_and_back_where_kv_swap_is_declared(fd_backend):
    caps = fd_backend.capabilities
    if not caps.kv_swap:
        pytest.skip("kv_swap is not declared (--swap-space is refused at start-up instead)")
    memory = fd_backend.memory()
    dtype = fd_backend.dtype
    device, _ = _filled(memory, dtype, 2)
    stored = [tuple(np.asarray(memory.to_numpy(t)) for t in pair) for pair in device]
    swap = memory.allocate_host_kv_cache(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype)
    memory.swap_blocks(device, swap, BLOCK_SIZE, [(1, 4), (5, 0)])
    fresh = _kv(memory, dtype)
    memory.swap_blocks(swap, fresh, BLOCK_SIZE, [(4, 2), (0, 3)])
    for layer, (pair, old) in enumerate(zip(fresh, stored)):
        for t, before in zip(pair, old):
            now = np.asarray(memory.to_numpy(t))
            np.testing.assert_array_equal(_blocks(now, 2), _blocks(before, 1), err_msg=f"layer {layer}")
            np.testing.assert_array_equal(_blocks(now, 3), _blocks(before, 5), err_msg=f"layer {layer}")
            assert not _blocks(now, 0).any(), "a block nobody swapped in changed"


def test_memory_queries_the_manifest_promises(fd_backend):
    caps = fd_backend.capabilities
    memory = fd_backend.memory()
    if caps.memory_query:
        free, total = memory.memory_info()
        assert isinstance(free, int) and isinstance(total, int) and 0 <= free <= total and total > 0, (free, total)
    if caps.memory_profiling:
        ran = []
        peak = memory.profile(lambda: ran.append(memory.from_numpy(np.ones((256, 1024), np.float32))))
        assert ran and isinstance(peak, int) and peak >= 0, peak
