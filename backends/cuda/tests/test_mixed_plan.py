"""The attention plan of captured mixed steps (``attention.MixedPlan``): fixed launches over
padded work items and rows give, for the step's rows, exactly the planned launches' output, and
touch no cache slot the step does not own. Runs in Triton's interpreter without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fd_core.interfaces.ops import AttentionMetadata  # noqa: E402
from fd_core.runtimes.torch.ops import upload  # noqa: E402
from test_kernels import DEVICE, SCENARIOS, host, make_batch, rand  # noqa: E402

from fd_backend_cuda import graphs  # noqa: E402
from fd_backend_cuda.kernels.attention import MixedPlan, paged_attention  # noqa: E402

HQ, HK, D, BLOCK = 4, 2, 32, 4
# the plan is keyed by the device as tensors report it ("cuda:0"), as the runner's is
PLAN_DEVICE = torch.device("cuda", torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE


def template(max_seqs: int, max_tokens: int, max_blocks: int,
             block_tables=None) -> tuple[AttentionMetadata, MixedPlan]:
    """As ``graphs._MixedGraph`` builds it: every sequence empty, every slot -1."""
    meta = AttentionMetadata(
        query_start_loc=np.zeros(max_seqs + 1, dtype=np.int64),
        seq_lens=np.zeros(max_seqs, dtype=np.int64),
        context_lens=np.zeros(max_seqs, dtype=np.int64),
        block_tables=np.zeros((max_seqs, 1), dtype=np.int64),
        slot_mapping=np.full(max_tokens, -1, dtype=np.int64),
        block_size=BLOCK,
    )
    plan = MixedPlan(meta, max_seqs, max_tokens, max_blocks, max_blocks * BLOCK, PLAN_DEVICE, block_tables)
    upload(plan.host, DEVICE, into=plan.buffer)
    return meta, plan


def tensors(n: int, tokens: int, num_blocks: int, seed: int):
    """q, k, v of ``tokens`` rows (the step's first ``n``, then padding) and a cache."""
    q, k, v = (rand((tokens, h, D), torch.float32, seed + i) for i, h in enumerate((HQ, HK, HK)))
    caches = tuple(rand((num_blocks * BLOCK, HK, D), torch.float32, seed + 5 + i) for i in range(2))
    return q, k, v, caches


def planned_and_captured(steps, max_seqs: int, max_tokens, num_blocks: int = 160, max_blocks: int = 64):
    """Each step of ``steps`` (a list of (context, new tokens) per sequence) run with its own
    plan and through a MixedPlan, refilled before each: the two outputs and caches.
    ``max_tokens``: one bucket, or several (plans sharing one block-table buffer, a step taking
    the smallest that holds it, as graphs.py does)."""
    buckets = sorted(max_tokens) if isinstance(max_tokens, list) else [max_tokens]
    plans = [template(max_seqs, buckets[0], max_blocks)]
    plans += [template(max_seqs, t, max_blocks, plans[0][1].block_tables) for t in buckets[1:]]
    warmed = set()
    results = []
    for i, seqs in enumerate(steps):
        meta = make_batch(seqs, BLOCK, num_blocks, seed=i)
        n = int(meta.query_start_loc[-1])
        which = next(j for j, t in enumerate(buckets) if t >= n)
        meta_t, plan = plans[which]
        q, k, v, caches = tensors(n, buckets[which], num_blocks, seed=10 * i)
        mine = tuple(c.clone() for c in caches)
        want = paged_attention(q[:n], k[:n], v[:n], caches, meta, D**-0.5)
        if which not in warmed:  # the warm-up run of capture: writes nothing, registers the launches
            warmed.add(which)
            before = tuple(c.clone() for c in mine)
            paged_attention(q, k, v, mine, meta_t, D**-0.5)
            assert all(torch.equal(a, b) for a, b in zip(before, mine))
        upload(plan.fill(meta), DEVICE, into=plan.buffer)
        upload(meta.block_tables.astype(np.int32), DEVICE,
               into=plan.block_tables[: meta.num_seqs, : meta.block_tables.shape[1]])
        got = paged_attention(q, k, v, mine, meta_t, D**-0.5)
        results.append((host(got[:n]), host(want), [host(c) for c in mine], [host(c) for c in caches]))
    return results, plan


@pytest.mark.parametrize("scenario", ["mixed", "prefill", "long", "decodes"])
def test_a_captured_plan_gives_the_planned_output(scenario):
    seqs = SCENARIOS[scenario]
    n = sum(q for _, q in seqs)
    results, _ = planned_and_captured([seqs], max_seqs=len(seqs) + 3, max_tokens=n + 21)
    for got, want, mine, theirs in results:
        np.testing.assert_array_equal(got, want)  # same kernels, same tiles: the same floats
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)  # padding rows wrote nothing


def test_a_refilled_plan_forgets_the_previous_step():
    """Steps of fewer sequences and items after larger ones (stale items and lengths must read
    as padding), and a step whose sequences fill every slot but the padding one."""
    steps = [SCENARIOS["long"] + SCENARIOS["prefill"], SCENARIOS["mixed"], [(5, 1)],
             [(2, 1)] * 7 + [(0, 30)]]
    results, plan = planned_and_captured(steps, max_seqs=8, max_tokens=240)
    for got, want, mine, theirs in results:
        np.testing.assert_array_equal(got, want)
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)


def test_buckets_sharing_block_tables():
    """Two buckets' plans share one block-table buffer; steps alternate between them, each
    writing its rows over the other's."""
    steps = [SCENARIOS["long"], SCENARIOS["mixed"], SCENARIOS["long"] + SCENARIOS["prefill"], [(9, 1), (40, 1)],
             SCENARIOS["prefill"]]
    results, plan = planned_and_captured(steps, max_seqs=8, max_tokens=[64, 240])
    for got, want, mine, theirs in results:
        np.testing.assert_array_equal(got, want)
        for a, b in zip(mine, theirs):
            np.testing.assert_array_equal(a, b)


def test_a_step_larger_than_the_bucket_is_refused():
    meta_t, plan = template(2, 16, 8)
    with pytest.raises(ValueError, match="3 sequences and 3 tokens exceeds the captured 2 and 16"):
        plan.fill(make_batch([(0, 1)] * 3, BLOCK, 20, 0))


def test_mixed_buckets_and_their_knob(monkeypatch):
    assert graphs.mixed_capture_sizes(8192) == [64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                                                6144, 8192]
    assert graphs.mixed_capture_sizes(1000) == [64, 128, 256, 384, 512, 768, 1000]
    assert graphs.mixed_capture_sizes(0) == []
    sizes = graphs.mixed_capture_sizes(1000)  # a step replays the smallest bucket that holds it
    assert [graphs._smallest(sizes, n) for n in (1, 64, 65, 999, 1000, 1001)] == [64, 64, 128, 1000, 1000, None]

    class Limits:
        max_num_batched_tokens = 2048

    monkeypatch.delenv("FD_CUDA_MIXED_GRAPH_TOKENS", raising=False)
    assert graphs.mixed_graph_tokens(Limits) == 2048  # never above the step budget
    monkeypatch.setenv("FD_CUDA_MIXED_GRAPH_TOKENS", "512")
    assert graphs.mixed_graph_tokens(Limits) == 512
    monkeypatch.setenv("FD_CUDA_MIXED_GRAPH_TOKENS", "0")
    assert graphs.mixed_graph_tokens(Limits) == 0
    for bad in ("lots", "-1"):
        monkeypatch.setenv("FD_CUDA_MIXED_GRAPH_TOKENS", bad)
        with pytest.raises(ValueError, match="FD_CUDA_MIXED_GRAPH_TOKENS"):
            graphs.mixed_graph_tokens(Limits)


class _ReplayByRerun:
    """A stand-in for a captured graph on the CPU: a replay runs the captured function again
    (reading the same buffers, as the kernels in a graph do) into the captured output."""

    def __init__(self, run, output) -> None:
        self.run, self.output = run, output

    def replay(self) -> None:
        self.output.copy_(self.run())


def test_mixed_graphs_replay_what_the_forward_computes(monkeypatch):
    """``graphs._MixedGraph`` end to end (on the CPU a stand-in graph re-runs the captured
    function): buckets of 64 and 96 tokens sharing their block tables, steps padded to them,
    the plan refilled, the output of each step's own rows that of the eager forward, and the
    cache written exactly where the eager step writes it."""
    from fd_core.interfaces import RunnerLimits

    if DEVICE.type != "cuda":  # a GPU captures real graphs
        monkeypatch.setattr(graphs, "_captured", lambda run, pool: (lambda out: (_ReplayByRerun(run, out), out))(run()))
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    limits = RunnerLimits(max_num_seqs=8, max_model_len=256, max_num_batched_tokens=96, block_size=BLOCK)
    g = torch.Generator().manual_seed(0)
    table = torch.randn((500, HQ * D), generator=g).to(DEVICE)

    def forward(ids, positions, kv_caches, meta):
        x = table[ids] + positions[:, None].float() / 100  # a row from its id and position
        q, kv = x.view(-1, HQ, D), x[:, : HK * D].reshape(-1, HK, D)
        return paged_attention(q, kv, kv * 0.5, kv_caches[0], meta, D**-0.5)

    num_blocks = 160
    cache = tuple(rand((num_blocks * BLOCK, HK, D), torch.float32, 50 + i) for i in range(2))
    eager_cache = tuple(c.clone() for c in cache)
    kv_caches = [cache]  # one list for the engine's life: another would make the graphs stale
    hooked = graphs.GraphedForward(forward, limits)
    assert hooked.mixed_sizes == [64, 96]
    steps = [SCENARIOS["mixed"], SCENARIOS["long"][:2] + [(5, 60), (0, 25)], SCENARIOS["prefill"], [(3, 1), (8, 40)]]
    for i, seqs in enumerate(steps):
        meta = make_batch(seqs, BLOCK, num_blocks, seed=i)
        n = int(meta.query_start_loc[-1])
        ids = torch.from_numpy(np.random.default_rng(i).integers(0, 500, n)).to(DEVICE)
        positions = torch.from_numpy(np.concatenate([np.arange(c, c + q) for c, q in seqs])).to(DEVICE)
        want = forward(ids, positions, [eager_cache], meta)
        graph = hooked._mixed_graph(hooked.mixed_bucket(n), kv_caches, PLAN_DEVICE)
        got = graph.replay(ids, positions, meta)
        assert got.shape[0] == n
        np.testing.assert_array_equal(host(got), host(want))
        for a, b in zip(cache, eager_cache):
            np.testing.assert_array_equal(host(a), host(b))
    assert sorted(hooked.mixed_graphs) == [64, 96]
    first, second = (hooked.mixed_graphs[t].plan.block_tables for t in (64, 96))
    assert first is second  # one block-table buffer for every bucket
