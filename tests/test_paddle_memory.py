"""PaddleMemory and PaddleCommunicator against the Memory and Communicator protocols."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fd_core.interfaces import Communicator, Memory
from fd_core.interfaces.ops import AttentionMetadata
from fd_core.runtimes.paddle import REFERENCE_OPS, PaddleCommunicator, PaddleMemory
from fd_core.testing import spec


@pytest.fixture(scope="module")
def memory() -> PaddleMemory:
    return PaddleMemory("cpu")


def test_implements_the_protocols(memory):
    assert isinstance(memory, Memory)
    assert isinstance(PaddleCommunicator(), Communicator)
    assert memory.device == "cpu"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int32, np.int8, np.float16])
def test_round_trip_keeps_values_and_dtype(memory, dtype):
    array = (np.arange(24).reshape(2, 3, 4) - 7).astype(dtype)
    tensor = memory.from_numpy(array)
    assert isinstance(tensor, paddle.Tensor)
    assert tensor.place.is_cpu_place()
    back = memory.to_numpy(tensor)
    assert back.dtype == dtype
    np.testing.assert_array_equal(back, array)


def test_bfloat16_bits_go_out_and_back_unconverted(memory):
    """The KV-cache transfer's wire form (API 1.15): a bfloat16 tensor as its uint16 bits, the
    same bits torch's Memory gives, and back to the same values."""
    pytest.importorskip("torch")
    from fd_core.runtimes.torch.memory import TorchMemory

    x = np.random.default_rng(0).standard_normal((4, 3, 8)).astype(np.float32)
    tensor = memory.from_numpy(x, "bfloat16")
    bits = memory.to_numpy_bits(tensor)
    assert bits.dtype == np.uint16 and bits.shape == x.shape
    torch_memory = TorchMemory()
    np.testing.assert_array_equal(bits, torch_memory.to_numpy_bits(torch_memory.from_numpy(x, "bfloat16")))
    back = memory.from_numpy_bits(bits, "bfloat16")
    assert back.dtype == paddle.bfloat16
    np.testing.assert_array_equal(memory.to_numpy(back), memory.to_numpy(tensor))


def test_from_numpy_copies(memory):
    array = np.ones(4, np.float32)
    tensor = memory.from_numpy(array)
    array[0] = 5
    assert memory.to_numpy(tensor)[0] == 1


def test_from_numpy_handles_non_contiguous_arrays(memory):
    array = np.arange(12, dtype=np.float32).reshape(3, 4).T
    np.testing.assert_array_equal(memory.to_numpy(memory.from_numpy(array)), array)


@pytest.mark.parametrize("dtype,rtol", [("bfloat16", 2**-8), ("float16", 2**-11), ("float32", 0)])
def test_from_numpy_casts_and_bfloat16_returns_as_float32(memory, dtype, rtol):
    array = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    tensor = memory.from_numpy(array, dtype)
    assert tensor.dtype == getattr(paddle, dtype)
    back = memory.to_numpy(tensor)
    assert back.dtype == (np.float16 if dtype == "float16" else np.float32)
    np.testing.assert_allclose(back.astype(np.float32), array, rtol=rtol, atol=0)
    if dtype != "float32":
        assert not np.array_equal(back, array)  # the cast really happened


def test_from_numpy_casts_integers(memory):
    tensor = memory.from_numpy(np.array([1, 2, 3], np.int32), "int64")
    assert tensor.dtype == paddle.int64


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_kv_cache_layout(memory, dtype):
    caches = memory.allocate_kv_cache(
        3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype
    )
    assert len(caches) == 3
    tensors = [t for pair in caches for t in pair]
    for t in tensors:
        assert t.shape == [20, 2, 8]
        assert t.dtype == getattr(paddle, dtype)
        assert not memory.to_numpy(t).any()
    # Every key and value is its own allocation.
    paddle.assign(paddle.ones([2, 8], dtype=dtype), tensors[0][3])
    assert memory.to_numpy(tensors[0]).sum() == 16
    assert all(memory.to_numpy(t).sum() == 0 for t in tensors[1:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_copy_blocks_copies_whole_blocks_in_every_layer_in_place(memory, dtype):
    rng = np.random.default_rng(1)
    bs, num_blocks = 4, 6
    host = [
        tuple(rng.standard_normal((num_blocks * bs, 2, 3)).astype(np.float32) for _ in range(2))
        for _ in range(2)
    ]
    caches = [tuple(memory.from_numpy(a, dtype) for a in pair) for pair in host]
    host = [tuple(memory.to_numpy(t) for t in pair) for pair in caches]  # after the cast
    originals = [tuple(t for t in pair) for pair in caches]
    # Block 1 is both copied from and overwritten: it is read before anything is written.
    pairs = [(1, 4), (0, 1), (2, 5)]
    memory.copy_blocks(caches, bs, pairs)
    for layer, pair in enumerate(caches):
        for which, tensor in enumerate(pair):
            assert tensor is originals[layer][which]
            expected = host[layer][which].reshape(num_blocks, bs, 2, 3).copy()
            before = expected.copy()
            for src, dst in pairs:
                expected[dst] = before[src]
            np.testing.assert_array_equal(memory.to_numpy(tensor).reshape(expected.shape), expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_swap_blocks_out_to_host_and_back(memory, dtype):
    rng = np.random.default_rng(2)
    bs, layers, heads, dim = 4, 2, 2, 3
    device = memory.allocate_kv_cache(layers, 6, bs, heads, dim, dtype)
    for pair in device:
        for t in pair:
            paddle.assign(memory.from_numpy(rng.standard_normal(t.shape).astype(np.float32), dtype), t)
    before = [tuple(memory.to_numpy(t).reshape(6, bs, heads, dim).copy() for t in pair) for pair in device]
    host = memory.allocate_host_kv_cache(layers, 3, bs, heads, dim, dtype)
    assert host[0][0].shape == [3 * bs, heads, dim] and host[0][0].dtype == getattr(paddle, dtype)
    memory.swap_blocks(device, host, bs, [(5, 0), (2, 2)])
    for layer in range(layers):
        for which in range(2):
            got = memory.to_numpy(host[layer][which]).reshape(3, bs, heads, dim)
            np.testing.assert_array_equal(got[0], before[layer][which][5])
            np.testing.assert_array_equal(got[2], before[layer][which][2])
            assert not got[1].any()  # untouched host block
    memory.swap_blocks(host, device, bs, [(0, 1), (2, 3)])  # back, into other device blocks
    for layer in range(layers):
        for which in range(2):
            got = memory.to_numpy(device[layer][which]).reshape(6, bs, heads, dim)
            np.testing.assert_array_equal(got[1], before[layer][which][5])
            np.testing.assert_array_equal(got[3], before[layer][which][2])
            np.testing.assert_array_equal(got[0], before[layer][which][0])  # others unchanged


def test_copy_blocks_with_nothing_to_copy(memory):
    caches = memory.allocate_kv_cache(1, 2, 4, 1, 2, "float32")
    memory.copy_blocks(caches, 4, [])
    assert not memory.to_numpy(caches[0][0]).any()


def test_memory_info_reports_host_ram(memory):
    free, total = memory.memory_info()
    assert 0 < free <= total
    with open("/proc/meminfo") as f:
        mem_total = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    assert total == mem_total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_writes_into_an_allocated_cache(memory, dtype):
    """The cache from allocate_kv_cache is what attention reads and writes, slot for slot."""
    rng = np.random.default_rng(2)
    bs = 4
    meta = AttentionMetadata(
        query_start_loc=np.array([0, 3, 4]),
        seq_lens=np.array([3, 6]),
        context_lens=np.array([0, 5]),
        block_tables=np.array([[2, 0], [3, 1]]),
        slot_mapping=np.array([8, 9, 10, 5]),  # seq 1, position 5: block 1, offset 1
        block_size=bs,
    )
    ((key, value),) = memory.allocate_kv_cache(1, 4, bs, 2, 8, dtype)
    q, k, v = (rng.standard_normal((4, h, 8)).astype(np.float32) for h in (4, 2, 2))
    host_cache = (memory.to_numpy(key), memory.to_numpy(value))
    out = REFERENCE_OPS["attention"](
        memory.from_numpy(q), memory.from_numpy(k), memory.from_numpy(v), (key, value), meta, 0.3
    )
    spec.attention(q, k, v, host_cache, meta, 0.3)
    rtol = 1e-2 if dtype == "bfloat16" else 0
    np.testing.assert_allclose(memory.to_numpy(key), host_cache[0], rtol=rtol, atol=rtol)
    np.testing.assert_allclose(memory.to_numpy(key)[[8, 9, 10, 5]], k, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(memory.to_numpy(value)[[8, 9, 10, 5]], v, rtol=rtol, atol=rtol)
    assert not memory.to_numpy(key)[[0, 1, 2, 3, 4, 6, 7, 11]].any()
    expected = spec.attention(q, k, v, host_cache, meta, 0.3)
    np.testing.assert_allclose(memory.to_numpy(out), expected, rtol=1e-4 + rtol, atol=1e-5 + rtol)


# --- communicator ------------------------------------------------------------------------------


def test_single_rank_collectives_are_the_identity():
    comm = PaddleCommunicator()
    assert (comm.rank, comm.world_size) == (0, 1)
    t = paddle.to_tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert comm.all_reduce(t) is t
    assert comm.broadcast(t, src=0) is t
    np.testing.assert_array_equal(comm.all_gather(t, axis=0).numpy(), t.numpy())
    np.testing.assert_array_equal(comm.all_gather(t).numpy(), t.numpy())
    assert comm.all_to_all([t])[0] is t
    comm.barrier()
    np.testing.assert_array_equal(t.numpy(), np.arange(6).reshape(2, 3))


def test_single_rank_send_and_recv_are_errors():
    comm = PaddleCommunicator()
    t = paddle.zeros([2])
    with pytest.raises(RuntimeError, match="world_size 1"):
        comm.send(t, dst=0)
    with pytest.raises(RuntimeError, match="world_size 1"):
        comm.recv(t, src=0)


def test_communicator_rejects_bad_ranks_and_lists():
    with pytest.raises(ValueError):
        PaddleCommunicator(rank=1, world_size=1)
    with pytest.raises(ValueError):
        PaddleCommunicator(rank=-1, world_size=2)
    with pytest.raises(ValueError):
        PaddleCommunicator().all_to_all([paddle.zeros([1]), paddle.zeros([1])])


WORKER = r"""
import json
import sys
import numpy as np
import paddle
import paddle.distributed as dist
from fd_core.runtimes.paddle import PaddleCommunicator


def worker(out_dir):
    dist.init_parallel_env()
    rank, size = dist.get_rank(), dist.get_world_size()
    comm = PaddleCommunicator(rank, size)
    f32 = lambda *v: paddle.to_tensor(np.array(v, np.float32))
    out = {
        "all_reduce": comm.all_reduce(f32(rank + 1.0, 10.0)).numpy().tolist(),
        "all_gather": comm.all_gather(f32(rank, rank).reshape([1, 2]), axis=0).numpy().tolist(),
        "broadcast": comm.broadcast(f32(rank * 5.0), src=1).numpy().tolist(),
        "all_to_all": [
            t.numpy().tolist() for t in comm.all_to_all([f32(10.0 * rank + j) for j in range(size)])
        ],
    }
    if rank == 0:
        comm.send(f32(42.0), dst=1)
    else:
        out["recv"] = comm.recv(paddle.zeros([1]), src=0).numpy().tolist()
    comm.barrier()
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    dist.spawn(worker, args=(sys.argv[1],), nprocs=2, backend="gloo")
"""


@pytest.mark.slow
def test_two_cpu_ranks_over_gloo(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    results = {
        rank: json.loads((tmp_path / f"rank{rank}.json").read_text())
        for rank in (0, 1)
        if (tmp_path / f"rank{rank}.json").exists()
    }
    assert set(results) == {0, 1}, run.stdout[-2000:] + run.stderr[-2000:]
    for rank, out in results.items():
        assert out["all_reduce"] == [3.0, 20.0]
        assert out["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert out["broadcast"] == [5.0]
        assert out["all_to_all"] == [[rank + 0.0], [10.0 + rank]]
    assert results[1]["recv"] == [42.0]
