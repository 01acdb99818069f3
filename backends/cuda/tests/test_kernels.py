"""The CUDA backend's Triton kernels against the executable specification (``fd_core.testing.spec``).

Without a CUDA device the kernels run on CPU tensors through Triton's interpreter
(``TRITON_INTERPRET=1``, set here before Triton is imported), so shapes are kept small. With a
device the same tests run natively. Each is held to ``spec.tolerance(op, dtype)``: float16 and bfloat16
are compared with the specification run in float32 on the same (rounded) inputs.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fd_core.errors import ConfigError
from fd_core.interfaces.ops import AttentionMetadata
from fd_core.quantization.kv_cache import quantized_cache, write_slots
from fd_core.models import rope
from fd_core.testing import spec

from fd_backend_cuda import ops
from fd_backend_cuda.kernels import attention
from fd_backend_cuda.kernels.attention import (
    _choose_splits,
    paged_attention,
    plan_launches,
    write_kv_cache,
)
from fd_backend_cuda.kernels.rms_norm import rms_norm as rms_norm_kernel
from fd_backend_cuda.kernels.rotary import rotary as rotary_kernel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

def tol(op: str, dtype: torch.dtype) -> dict:
    """The spec's stated tolerance of ``op`` in ``dtype`` (the conformance kit's)."""
    return spec.tolerance(op, str(dtype).removeprefix("torch."))


def rand(shape, dtype, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def host(t: torch.Tensor) -> np.ndarray:
    """Float32 (for floating tensors) NumPy copy: exact for every dtype here."""
    t = t.detach().cpu()
    return t.float().numpy() if t.is_floating_point() else t.numpy()


def close(actual: torch.Tensor, expected: np.ndarray, tolerance: dict) -> None:
    np.testing.assert_allclose(host(actual), expected.astype(np.float32), **tolerance)


# --- rms_norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 128, 80])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    x = rand((2, 3, hidden), dtype, 1, scale=3.0)
    w = rand((hidden,), dtype, 2)
    res = rand((2, 3, hidden), dtype, 3) if with_residual else None
    x_before = x.clone()
    got = ops.rms_norm(x, w, 1e-6, res)
    want = spec.rms_norm(host(x), host(w), 1e-6, None if res is None else host(res))
    if with_residual:
        assert isinstance(got, tuple) and got[0].dtype == dtype and got[1].dtype == dtype
        close(got[0], want[0], tol("rms_norm", dtype))
        close(got[1], want[1], tol("rms_norm", dtype))
    else:
        assert got.dtype == dtype and got.shape == x.shape
        close(got, want, tol("rms_norm", dtype))
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_chunked_rows(with_residual):
    """Rows wider than the register block take the two-pass loop; same results."""
    x = rand((5, 200), torch.float32, 4)
    w = rand((200,), torch.float32, 5)
    res = rand((5, 200), torch.float32, 6) if with_residual else None
    got = rms_norm_kernel(x, w, 1e-5, res, max_block=64)
    want = spec.rms_norm(host(x), host(w), 1e-5, None if res is None else host(res))
    if with_residual:
        close(got[0], want[0], tol("rms_norm", torch.float32))
        close(got[1], want[1], tol("rms_norm", torch.float32))
    else:
        close(got, want, tol("rms_norm", torch.float32))


def test_rms_norm_strided_rows():
    base = rand((4, 96), torch.float32, 7)
    x = base[:, :64]  # row stride 96
    w = rand((64,), torch.float32, 8)
    close(
        ops.rms_norm(x, w, 1e-6),
        spec.rms_norm(host(x), host(w), 1e-6),
        tol("rms_norm", torch.float32),
    )


# --- rotary ------------------------------------------------------------------------------------


def cos_sin_table(positions: int, rot: int, base: float = 10000.0) -> torch.Tensor:
    return torch.from_numpy(rope.cos_sin_table(rot, positions, base)).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize(
    "heads,head_dim,rot", [((4, 2), 32, 32), ((2, 2), 64, 32), ((4, 1), 48, 20)]
)
def test_rotary(dtype, style, heads, head_dim, rot):
    n = 7
    positions = torch.tensor([0, 3, 63, 17, 5, 5, 40], dtype=torch.int64, device=DEVICE)
    q = rand((n, heads[0], head_dim), dtype, 10, scale=2.0)
    k = rand((n, heads[1], head_dim), dtype, 11, scale=2.0)
    cs = cos_sin_table(64, rot)
    q_before, k_before = q.clone(), k.clone()
    got_q, got_k = ops.rotary(positions, q, k, cs, style)
    want_q, want_k = spec.rotary(host(positions), host(q), host(k), host(cs), style)
    assert got_q.dtype == dtype and got_k.dtype == dtype
    close(got_q, want_q, tol("rotary", dtype))
    close(got_k, want_k, tol("rotary", dtype))
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # new tensors, inputs intact


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rotary_strided_views_and_inplace(style):
    """q and k as slices of a fused qkv output; the in-place variant rotates them there."""
    n, hq, hk, d, rot = 5, 4, 2, 32, 16
    qkv = rand((n, (hq + 2 * hk) * d), torch.float32, 12)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(n, hk, d)
    positions = torch.tensor([1, 2, 9, 30, 31], dtype=torch.int64, device=DEVICE)
    cs = cos_sin_table(32, rot)
    want_q, want_k = spec.rotary(host(positions), host(q), host(k), host(cs), style)
    got_q, got_k = ops.rotary(positions, q, k, cs, style)
    close(got_q, want_q, tol("rotary", torch.float32))
    close(got_k, want_k, tol("rotary", torch.float32))
    v_before = qkv[:, (hq + hk) * d :].clone()
    rq, rk = rotary_kernel(positions, q, k, cs, style, inplace=True)
    assert rq.data_ptr() == q.data_ptr() and rk.data_ptr() == k.data_ptr()
    close(q, want_q, tol("rotary", torch.float32))
    close(k, want_k, tol("rotary", torch.float32))
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def test_rotary_rejects_unknown_style():
    q = rand((1, 1, 8), torch.float32, 0)
    with pytest.raises(ValueError):
        ops.rotary(
            torch.zeros(1, dtype=torch.int64, device=DEVICE),
            q,
            q,
            cos_sin_table(4, 8),
            "bogus",
        )


# --- silu_and_mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(5, 128), (3, 80), (2, 3, 64)])
def test_silu_and_mul(dtype, shape):
    x = rand(shape, dtype, 20, scale=4.0)
    got = ops.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (*shape[:-1], shape[-1] // 2)
    close(got, spec.silu_and_mul(host(x)), tol("silu_and_mul", dtype))


# --- attention ---------------------------------------------------------------------------------

# Batches of (context_len, query_len) per sequence.
SCENARIOS = {
    # several decodes of various context lengths (one a 1-token prompt), a prefill chunk over a
    # cached context, a fresh prefill
    "mixed": [(6, 1), (0, 19), (21, 1), (11, 6), (45, 1), (1, 1), (0, 1)],
    # decodes only; the longest spans three key tiles
    "decodes": [(3, 1), (30, 1), (0, 1), (17, 1), (130, 1)],
    # prefill chunks only: fresh, over a cached context, short; one sequence with no new tokens
    "prefill": [(0, 40), (20, 5), (9, 0), (3, 17)],
    # many blocks through a shuffled block table; a prefill over several query tiles
    "long": [(57, 3), (70, 1), (5, 150)],
}


def make_batch(seqs, block_size, num_blocks, seed):
    """Metadata with block tables drawn from a shuffled pool, padded with 0."""
    rng = np.random.default_rng(seed)
    pool = list(rng.permutation(num_blocks))
    blocks_per_seq = [-(-(c + q) // block_size) for c, q in seqs]
    width = max(blocks_per_seq)
    tables = np.zeros((len(seqs), width), dtype=np.int64)
    for i, nb in enumerate(blocks_per_seq):
        tables[i, :nb] = [pool.pop() for _ in range(nb)]
    qlens = np.array([q for _, q in seqs], dtype=np.int64)
    ctx = np.array([c for c, _ in seqs], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)
    slots = []
    for i, (c, q) in enumerate(seqs):
        pos = np.arange(c, c + q)
        slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
    return AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=ctx + qlens,
        context_lens=ctx,
        block_tables=tables,
        slot_mapping=np.concatenate(slots).astype(np.int64),
        block_size=block_size,
    )


def run_attention(
    seqs, heads, head_dim, block_size, dtype, cache_dtype=None, seed=0, num_splits=None
):
    cache_dtype = cache_dtype or dtype
    hq, hk = heads
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 3  # a few never touched
    meta = make_batch(seqs, block_size, num_blocks, seed)
    n = int(meta.query_start_loc[-1])
    q = rand((n, hq, head_dim), dtype, seed + 1)
    k = rand((n, hk, head_dim), dtype, seed + 2)
    v = rand((n, hk, head_dim), dtype, seed + 3)
    key_cache = rand((num_blocks * block_size, hk, head_dim), cache_dtype, seed + 4)
    value_cache = rand((num_blocks * block_size, hk, head_dim), cache_dtype, seed + 5)
    scale = head_dim**-0.5

    # The spec in float32 on the same (rounded) values; casting k to a float32 cache is exact
    # only if the cache is no narrower than k, so round k, v through the cache dtype first.
    spec_cache = (host(key_cache), host(value_cache))
    k_in = host(k.to(cache_dtype))
    v_in = host(v.to(cache_dtype))
    want = spec.attention(host(q), k_in, v_in, spec_cache, meta, scale)

    out = paged_attention(q, k, v, (key_cache, value_cache), meta, scale, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == q.shape
    # K/V went to exactly their slots, cast to the cache dtype; every other slot is unchanged.
    np.testing.assert_array_equal(host(key_cache), spec_cache[0])
    np.testing.assert_array_equal(host(value_cache), spec_cache[1])
    return out, want, meta


ATTN_CASES = [
    # (scenario, (Hq, Hk), head_dim, block_size)
    (scenario, heads, head_dim, block_size)
    for scenario in SCENARIOS
    for heads in [(4, 2), (2, 2)]
    for head_dim, block_size in [(32, 4), (64, 16)]
]


@pytest.mark.parametrize("scenario,heads,head_dim,block_size", ATTN_CASES)
def test_attention_float32(scenario, heads, head_dim, block_size):
    out, want, _ = run_attention(SCENARIOS[scenario], heads, head_dim, block_size, torch.float32)
    close(out, want, spec.TOLERANCES["attention"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scenario", ["mixed", "long"])
@pytest.mark.parametrize("heads,head_dim,block_size", [((4, 2), 32, 4), ((2, 2), 64, 16)])
def test_attention_half(dtype, scenario, heads, head_dim, block_size):
    out, want, _ = run_attention(SCENARIOS[scenario], heads, head_dim, block_size, dtype, seed=3)
    close(out, want, tol("attention", dtype))


def test_attention_query_and_cache_dtypes_differ():
    """float16 q/k/v over a float32 cache: k, v stored as float32, math in float32."""
    out, want, _ = run_attention(
        SCENARIOS["mixed"],
        (4, 2),
        32,
        4,
        torch.float16,
        cache_dtype=torch.float32,
        seed=5,
    )
    close(out, want, tol("attention", torch.float16))


@pytest.mark.parametrize(
    "scenario,num_splits,dtype",
    [
        ("mixed", 2, torch.float32),
        ("long", 3, torch.float32),
        ("decodes", 4, torch.float16),
    ],
)
def test_attention_split_k(scenario, num_splits, dtype):
    """Flash-decoding path: key ranges split across programs, merged by the last of them to
    finish (including empty segments for short sequences), which leaves every arrival counter
    at zero: a second call through the same launches (as a graph replays them) merges again."""
    out, want, meta = run_attention(
        SCENARIOS[scenario], (4, 2), 32, 4, dtype, seed=7, num_splits=num_splits
    )
    close(out, want, tol("attention", dtype))
    split = [launch for launch in _launches(meta) if launch.num_splits > 1]
    assert split and all(int(launch.scratch[3].abs().sum()) == 0 for launch in split)
    n = int(meta.query_start_loc[-1])
    q, k, v = (rand((n, h, 32), dtype, 40 + i) for i, h in enumerate((4, 2, 2)))
    blocks = sum(-(-(c + t) // 4) for c, t in SCENARIOS[scenario]) + 3
    key_cache, value_cache = (rand((blocks * 4, 2, 32), dtype, 50 + i) for i in range(2))
    k_in, v_in = host(k.to(dtype)), host(v.to(dtype))
    again = spec.attention(host(q), k_in, v_in, (host(key_cache), host(value_cache)), meta, 32**-0.5)
    close(paged_attention(q, k, v, (key_cache, value_cache), meta, 32**-0.5, num_splits=num_splits),
          again, tol("attention", dtype))


def _launches(meta) -> list:
    return [launch for plan in meta.device.values() if isinstance(plan, list) for launch in plan]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scenario,head_dim,num_splits", [("long", 32, None), ("mixed", 48, None), ("long", 32, 2)])
def test_attention_unmasked_tiles_below_the_diagonal(monkeypatch, dtype, scenario, head_dim, num_splits):
    """Every prefill launch takes the loop of unmasked key tiles below the diagonal
    (``SPLIT_MASK_KEYS`` lowered from 2,048), with a ragged head_dim and split-K too: still the
    specification's output."""
    monkeypatch.setattr(attention, "SPLIT_MASK_KEYS", 1)
    seqs = SCENARIOS[scenario] + [(100, 70)]  # a chunk whose tiles see 100+ cached keys
    out, want, meta = run_attention(seqs, (4, 2), head_dim, 4, dtype, seed=13, num_splits=num_splits)
    close(out, want, tol("attention", dtype))
    assert [launch.split_mask for launch in _launches(meta)] == [False, True]  # decodes, prefills


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_unmasked_tiles_over_a_quantized_cache(monkeypatch, dtype):
    monkeypatch.setattr(attention, "SPLIT_MASK_KEYS", 1)
    out, want = run_quantized_cache(SCENARIOS["long"] + [(100, 70)], (4, 2), 64, 16, dtype, "int8", seed=17)
    close(out, want, tol("attention", dtype))


def test_only_long_prefill_launches_take_the_unmasked_loop():
    meta = make_batch([(0, 1), (0, 2 * 64), (attention.SPLIT_MASK_KEYS - 64, 64)], 16, 200, 0)
    small, big = plan_launches(meta, 2, 2, 64, DEVICE)
    assert not small.split_mask and big.split_mask  # the 2,048-key chunk makes the launch's case
    short = make_batch([(0, 1), (0, 2 * 64)], 16, 40, 0)
    assert [launch.split_mask for launch in plan_launches(short, 2, 2, 64, DEVICE)] == [False, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scenario,num_splits", [("long", None), ("mixed", None), ("long", 2)])
def test_attention_programs_in_item_major_order(monkeypatch, dtype, scenario, num_splits):
    """A prefill launch whose programs start item by item (grid ``(Hk, items, splits)``), with
    split-K too, gives the specification's output; the short-query launch keeps its order."""
    monkeypatch.setattr(attention, "_item_major", lambda keys, num_kv_heads, slots: True)
    out, want, meta = run_attention(SCENARIOS[scenario], (4, 2), 32, 4, dtype, seed=19, num_splits=num_splits)
    close(out, want, tol("attention", dtype))
    launches = _launches(meta)
    assert [launch.item_major for launch in launches] == [False, True]  # decodes, prefills
    assert launches[1].num_splits == (num_splits or 1)


def _keys(prompts: list[tuple[int, int]], block_q: int) -> np.ndarray:
    qlens = np.array([n for _, n in prompts])
    ctx = np.array([c for c, _ in prompts])
    return attention._items(qlens, ctx, ctx + qlens, np.arange(len(prompts)), block_q)[2]


def test_item_major_where_a_kv_head_by_kv_head_launch_ends_on_a_long_tail():
    """The launches measured on an H200 (docs/PERFORMANCE.md), with their programs a
    multiprocessor held: item-major where it ended them sooner, not where L2 locality won."""
    # one 4,096-token prompt, 32 / 8 heads (block_q 32), two programs an SM: 488 -> 409 us
    assert attention._item_major(_keys([(0, 4096)], 32), 8, 2 * 132)
    # a 2,048-token chunk over 6,144 cached, same heads: 733 -> 668 us
    assert attention._item_major(_keys([(6144, 2048)], 32), 8, 2 * 132)
    # head_dim 256, 8 / 8 heads (block_q 128), one program an SM: 312 -> 214 us
    assert attention._item_major(_keys([(0, 4096)], 128), 8, 132)
    # many waves: four 4,096-token prompts (1,631 -> 1,691 us), eight of 1,024 (293 -> 310 us)
    assert not attention._item_major(_keys([(0, 4096)] * 4, 32), 8, 2 * 132)
    assert not attention._item_major(_keys([(0, 1024)] * 8, 32), 8, 2 * 132)
    # items of equal length: a 2,048-token chunk of 16 / 2 heads (380 -> 389 us)
    assert not attention._item_major(_keys([(6144, 2048)], 16), 2, 2 * 132)
    assert not attention._item_major(_keys([(0, 4096)], 32), 8, 4096)  # one wave
    assert not attention._item_major(_keys([(0, 4096)], 128), 1, 132)  # one kv head


def test_item_major_planner_reads_the_tile_residency(monkeypatch):
    """The planner simulates ``SMs x programs an SM holds`` slots: the recorded figure of the
    prefill tile, else ``DEFAULT_RESIDENT``, and marks a launch of an unrecorded tile to record
    it; the short-query launch is not simulated."""
    asked = []
    monkeypatch.setattr(attention, "_item_major", lambda keys, num_kv_heads, slots: asked.append(slots) or False)
    monkeypatch.setattr(attention, "_RESIDENT", {})
    seqs = [(0, 1), (0, 2 * 64)]
    small, big = plan_launches(make_batch(seqs, 16, 40, 0), 2, 2, 64, DEVICE)
    key = attention._tile_key(DEVICE, attention._tiles(2, 64, False)[1], 64)
    sms = attention.sm_count(DEVICE)
    assert asked == [sms * attention.DEFAULT_RESIDENT] and big.resident_key == key and small.resident_key is None
    attention._RESIDENT[key] = 5
    small, big = plan_launches(make_batch(seqs, 16, 40, 0), 2, 2, 64, DEVICE)
    assert asked[1:] == [sms * 5] and big.resident_key is None


def test_resident_programs_takes_the_tightest_limit(monkeypatch):
    from types import SimpleNamespace

    from fd_backend_cuda.kernels import _common

    props = SimpleNamespace(shared_memory_per_multiprocessor=233472, regs_per_multiprocessor=65536,
                            max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    cuda = torch.device("cuda", 0)

    def compiled(shared, regs, warps):
        return SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(shared=shared, num_warps=warps))

    assert _common.resident_programs(cuda, compiled(98304, 128, 4)) == 2  # shared memory: 2 x 97 KiB
    assert _common.resident_programs(cuda, compiled(16384, 168, 4)) == 3  # registers: 65536 // (168 x 128)
    assert _common.resident_programs(cuda, compiled(0, 32, 8)) == 8  # threads: 2048 // 256
    assert _common.resident_programs(cuda, compiled(200000, 32, 4)) == 1  # at least one
    assert _common.resident_programs(torch.device("cpu"), compiled(0, 32, 4)) is None
    del props.shared_memory_per_multiprocessor  # a torch that does not report it
    assert _common.resident_programs(cuda, compiled(0, 32, 4)) is None


def test_split_k_heuristic():
    assert _choose_splits(programs=8, max_keys=8192, num_sms=132) == 32
    assert _choose_splits(programs=64, max_keys=2048, num_sms=132) == 4  # 5 wanted: a power of two
    assert _choose_splits(programs=16, max_keys=8192, num_sms=132) == 16  # 17 wanted
    assert _choose_splits(programs=64, max_keys=400, num_sms=132) == 1  # too short to split
    assert _choose_splits(programs=264, max_keys=8192, num_sms=132) == 1  # a full wave already


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_attention_large_head_dims(dtype, head_dim):
    """The tiles chosen for wide heads (on a GPU: they must fit in shared memory)."""
    out, want, _ = run_attention(SCENARIOS["mixed"], (4, 2), head_dim, 16, dtype, seed=13)
    close(out, want, tol("attention", dtype))


@pytest.mark.parametrize("scenario", ["mixed", "long"])
def test_attention_group_of_eight_odd_head_dim_odd_block_size(scenario):
    """G = 8 (one kv head), head_dim 48 padded to 64, block_size 3."""
    out, want, _ = run_attention(SCENARIOS[scenario], (8, 1), 48, 3, torch.float32, seed=9)
    close(out, want, spec.TOLERANCES["attention"])


def test_attention_metadata_uploaded_once_per_step():
    """Two layers share one step's metadata: uploads and plans are made by the first."""
    seqs = SCENARIOS["mixed"]
    meta = make_batch(seqs, 4, 40, 11)
    n = int(meta.query_start_loc[-1])
    outs, wants = [], []
    for layer in range(2):
        q = rand((n, 4, 32), torch.float32, 100 + layer)
        k = rand((n, 2, 32), torch.float32, 200 + layer)
        v = rand((n, 2, 32), torch.float32, 300 + layer)
        kc = rand((160, 2, 32), torch.float32, 400 + layer)
        vc = rand((160, 2, 32), torch.float32, 500 + layer)
        wants.append(spec.attention(host(q), host(k), host(v), (host(kc), host(vc)), meta, 0.2))
        if layer == 1:
            cached = dict(meta.device)
        outs.append(ops.attention(q, k, v, (kc, vc), meta, 0.2))
        if layer == 1:
            assert all(meta.device[key] is cached[key] for key in cached)
            assert set(meta.device) == set(cached)
    step = next(val for key, val in meta.device.items() if key.startswith("cuda.step"))
    assert step.block_tables.dtype == torch.int32 and step.slot_mapping.dtype == torch.int64
    assert step.block_tables.device.type == DEVICE.type
    for out, want in zip(outs, wants, strict=True):
        close(out, want, spec.TOLERANCES["attention"])


def test_attention_plan_covers_every_row_once():
    """Host planning: every query row of every sequence is in exactly one item of one launch."""
    seqs = SCENARIOS["mixed"] + [(3, 200), (0, 2), (5, 0)]
    meta = make_batch(seqs, 16, 64, 1)
    for (heads, head_dim), wide in itertools.product(
        (((4, 2), 32), ((8, 1), 128), ((2, 2), 256), ((32, 1), 64)), (False, True)
    ):
        group = heads[0] // heads[1]
        covered = np.zeros(int(meta.query_start_loc[-1]), dtype=np.int64)
        for launch in plan_launches(
            meta, heads[1], group, head_dim, torch.device("cpu"), wide=wide
        ):
            block_q = launch.block_m // group
            for seq, tok in zip(launch.item_seq.tolist(), launch.item_tok.tolist(), strict=True):
                start, end = meta.query_start_loc[seq], meta.query_start_loc[seq + 1]
                covered[start + tok : min(start + tok + block_q, end)] += 1
        assert np.all(covered == 1)


def run_quantized_cache(seqs, heads, head_dim, block_size, dtype, kv, seed=0, num_splits=None):
    """As run_attention over an int8 / fp8_e4m3 cache (fd_core.quantization.kv_cache's format):
    the rows written must be the specification's bytes."""
    hq, hk = heads
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 3
    meta = make_batch(seqs, block_size, num_blocks, seed)
    n = int(meta.query_start_loc[-1])
    q, k, v = (rand((n, h, head_dim), dtype, seed + i) for i, h in enumerate((hq, hk, hk), 1))
    shape = (num_blocks * block_size, hk, head_dim)
    spec_cache = tuple(quantized_cache(host(rand(shape, torch.float32, seed + i)), kv, block_size) for i in (4, 5))
    key_cache, value_cache = (torch.from_numpy(c.copy()).to(DEVICE) for c in spec_cache)
    scale = head_dim**-0.5
    want = spec.attention(host(q), host(k), host(v), spec_cache, meta, scale)
    out = paged_attention(q, k, v, (key_cache, value_cache), meta, scale, num_splits=num_splits)
    np.testing.assert_array_equal(host(key_cache), spec_cache[0])
    np.testing.assert_array_equal(host(value_cache), spec_cache[1])
    return out, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("style,heads,head_dim,rot,kv", [
    ("neox", (4, 2), 32, 32, None), ("interleaved", (4, 2), 32, 32, None), ("neox", (2, 2), 48, 20, None),
    ("interleaved", (4, 1), 64, 32, "int8"),
])
def test_rotary_attention_is_rotary_then_attention(dtype, style, heads, head_dim, rot, kv):
    """The fused op (q and k rotated by the kernel that writes the cache) gives what the rotary
    op and then attention give: q and k read as slices of one fused qkv output, a partial
    rotary dim, a quantized cache. Both kernels rotate with ``rotary.rotated``: bit for bit in
    the interpreter. On a GPU, within the rounding of the rotation: the compiler may contract
    the float32 rotation into FMAs differently in the two kernels (an H200 did, when each had a
    rotation of its own)."""
    hq, hk = heads
    seqs = SCENARIOS["mixed"]
    num_blocks = sum(-(-(c + q) // 4) for c, q in seqs) + 3
    meta = make_batch(seqs, 4, num_blocks, 31)
    n = int(meta.query_start_loc[-1])
    qkv = rand((n, (hq + 2 * hk) * head_dim), dtype, 32, scale=2.0)
    q = qkv[:, : hq * head_dim].view(n, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(n, hk, head_dim)
    v = qkv[:, (hq + hk) * head_dim :].view(n, hk, head_dim)
    qlens = np.diff(meta.query_start_loc)
    positions = torch.from_numpy(np.repeat(meta.context_lens, qlens) + np.arange(n)
                                 - np.repeat(meta.query_start_loc[:-1], qlens)).to(DEVICE)
    cs = cos_sin_table(64, rot)
    shape = (num_blocks * 4, hk, head_dim)
    if kv is None:
        caches = [rand(shape, dtype, 33 + i) for i in range(2)]
    else:
        caches = [torch.from_numpy(quantized_cache(host(rand(shape, torch.float32, 33 + i)), kv, 4)).to(DEVICE)
                  for i in range(2)]
    fused_caches = [c.clone() for c in caches]
    rq, rk = ops.rotary(positions, q, k, cs, style)
    want = ops.attention(rq, rk, v, tuple(caches), meta, head_dim**-0.5)
    got = ops.rotary_attention(positions, q, k, v, cs, style, tuple(fused_caches), meta, head_dim**-0.5)
    if DEVICE.type == "cpu":
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(fused_caches, caches))
        return
    close(got, host(want), tol("attention", dtype))
    if kv is None:
        for a, b in zip(fused_caches, caches):
            close(a, host(b), tol("rotary", dtype))


# fp8 needs float8 conversions: sm89+ on a GPU. Triton 3.6's interpreter rounds float32 to e4m3
# without carrying into the exponent (1.95 becomes 1.0, not 2.0), so it runs on a GPU only.
KV_FORMATS = ["int8", pytest.param("fp8_e4m3", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="float8 e4m3 conversions need sm89+ (the Triton interpreter's are wrong)"))]


@pytest.mark.parametrize("kv", KV_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scenario,num_splits", [("mixed", None), ("long", None), ("decodes", 2)])
def test_attention_quantized_cache(kv, dtype, scenario, num_splits):
    out, want = run_quantized_cache(SCENARIOS[scenario], (4, 2), 64, 16, dtype, kv, seed=11,
                                    num_splits=num_splits)
    close(out, want, tol("attention", dtype))


def test_attention_refuses_a_quantized_cache_without_its_scales():
    q = rand((2, 2, 16), torch.float32, 1)
    cache = torch.zeros((8, 2, 16), dtype=torch.int8, device=DEVICE)
    meta = make_batch([(0, 2)], 4, 2, 0)
    with pytest.raises(ValueError, match=r"key_cache shape \(8, 2, 16\) vs \[\*, 2, 18\]"):
        paged_attention(q, q, q, (cache, cache.clone()), meta, 0.25)


def test_write_kv_cache_skips_negative_slots():
    k = rand((3, 2, 16), torch.float32, 1)
    v = rand((3, 2, 16), torch.float32, 2)
    kc = torch.zeros((8, 2, 16), device=DEVICE)
    vc = torch.zeros((8, 2, 16), device=DEVICE)
    write_kv_cache(k, v, kc, vc, torch.tensor([5, -1, 0], dtype=torch.int64, device=DEVICE), 4)
    assert torch.equal(kc[5], k[0]) and torch.equal(kc[0], k[2]) and torch.equal(vc[5], v[0])
    assert torch.count_nonzero(kc[1:5]) == 0 and torch.count_nonzero(kc[6:]) == 0


def test_write_kv_cache_quantized_skips_negative_slots():
    k = rand((3, 2, 16), torch.float32, 1)
    kc = torch.zeros((8, 2, 18), dtype=torch.int8, device=DEVICE)
    vc = torch.zeros_like(kc)
    slots = np.array([5, -1, 0])
    write_kv_cache(k, k, kc, vc, torch.tensor(slots, dtype=torch.int64, device=DEVICE), 4)
    want = np.zeros((8, 2, 18), dtype=np.int8)
    write_slots(want, 4, slots[slots >= 0], host(k)[slots >= 0])
    np.testing.assert_array_equal(host(kc), want)


def test_programmatic_dependent_launch_setting(monkeypatch):
    """``FD_CUDA_PDL``: kernels on the CPU (the interpreter) never take it; on a GPU 0 turns it
    off, and anything but 0 or 1 stops with the variable's name."""
    from fd_backend_cuda.kernels import _common

    assert _common.pdl(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("FD_CUDA_PDL", "0")
    assert _common._pdl.__wrapped__(0) is False
    monkeypatch.setenv("FD_CUDA_PDL", "yes")
    with pytest.raises(ConfigError, match="FD_CUDA_PDL must be 0 or 1"):
        _common._pdl.__wrapped__(0)


def test_kernels_launched_with_pdl_touch_nothing_before_waiting():
    """Every kernel with a ``PDL`` parameter calls ``pdl_start(PDL)`` in its body's top level,
    and before it reads only through the pointers ``READ_BEFORE_WAIT`` names (weights: no kernel
    of a step writes them) and stores nothing: under programmatic dependent launch it may be
    running while the kernel before it still is, and only that wait orders its loads and stores
    after that kernel's."""
    import ast
    import inspect

    from fd_backend_cuda import kernels

    read_before_wait = {"_gemv_kernel": {"w_ptr"}, "_gemv_fp8_kernel": {"w_ptr"}, "_rms_norm_kernel": {"w_ptr"},
                        "_int4_row_kernel": {"w_ptr", "s_ptr", "z_ptr"},
                        # the step's metadata: written before the layers' kernels (attention.py)
                        "_attention_kernel": {"item_seq_ptr", "item_tok_ptr", "qsl_ptr", "seq_lens_ptr",
                                              "ctx_lens_ptr", "bt_ptr"}}
    found = []
    for path in sorted(Path(inspect.getfile(kernels)).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                if node.name == "pdl_start":
                    continue
                found.append(node.name)
                body = [n for n in node.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
                starts = [i for i, n in enumerate(body) if ast.unparse(n) == "pdl_start(PDL)"]
                assert len(starts) == 1, (path.name, node.name)
                pointers = {a.arg for a in node.args.args if a.arg.endswith("_ptr")}
                allowed = read_before_wait.get(node.name, set())
                for stmt in body[: starts[0]]:
                    names = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
                    assert names & pointers <= allowed, (path.name, node.name, ast.unparse(stmt))
                    calls = {ast.unparse(n.func) for n in ast.walk(stmt) if isinstance(n, ast.Call)}
                    assert not any("store" in c or "atomic" in c for c in calls), (path.name, node.name)
    assert {"_rms_norm_kernel", "_gemv_kernel", "_gemv_dot_kernel", "_kv_write_kernel", "_attention_kernel",
            "_silu_and_mul_kernel", "_rotary_kernel", "_int4_gemv_kernel", "_gemv_fp8_kernel",
            "_int4_row_kernel"} <= set(found)


def test_supports():
    assert ops.supports("attention", torch.bfloat16, 128)
    assert not ops.supports("attention", torch.float16, 512)
    assert not ops.supports("rms_norm", torch.int32)
    assert ops.supports("moe", torch.bfloat16)
    assert not ops.supports("moe", torch.int32)
    assert not ops.supports("linear")
    assert not ops.supports("rotary_attention", torch.float16, 512)  # attention's limits
    assert set(ops.OPS) == {"rms_norm", "rotary", "silu_and_mul", "attention", "rotary_attention", "sample",
                            "sample_async", "deferred_bitmask"}
