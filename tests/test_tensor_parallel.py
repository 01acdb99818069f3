"""Tensor parallelism on the CPU: two processes over gloo give what one process gives."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import zmq

pytest.importorskip("transformers")  # the checkpoints are built with transformers

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.executor import Workers  # noqa: E402
from fd_core.errors import BackendError, ConfigError  # noqa: E402
from fd_core.models.parallel import TensorParallel  # noqa: E402
from tests import checkpoints  # noqa: E402


def prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(3, 400, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def generate(model_dir, params, **engine_args):
    llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, block_size=4, **engine_args)
    try:
        return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts(), params, use_tqdm=False)], llm
    finally:
        llm.engine.core.shutdown()


@pytest.mark.parametrize("make", [checkpoints.make_llama, checkpoints.make_qwen3], ids=["llama", "qwen3-tied"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.5, seed=3, max_tokens=16, ignore_eos=True, n=2),
], ids=["greedy", "seeded-n2"])
def test_two_ranks_equal_one(tmp_path, make, params):
    model_dir = make(tmp_path)
    one, _ = generate(model_dir, params, num_kv_blocks=512)
    two, llm = generate(model_dir, params, num_kv_blocks=512, tensor_parallel_size=2)
    assert llm.engine.core.executor.workers.world_size == 2 and llm.engine.runner is None
    assert two == one
    # the block copies, swaps and recomputation of a tight cache run on both ranks alike
    tight, llm = generate(model_dir, params, num_kv_blocks=4 * 16 + 1, tensor_parallel_size=2, swap_space=0.01)
    assert llm.engine.scheduler.num_swapped_out > 0
    assert tight == one


def test_two_ranks_score_prompts_as_one(tmp_path):
    """Prompt logprobs gather the ranks' vocabulary slices of every prompt position (each rank
    joins the collectives of the logits; rank 0 scores them) over chunked prefill."""
    model_dir = checkpoints.make_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outs = []
    for world in (1, 2):
        llm = LLM(model=str(model_dir), device="cpu", max_model_len=128, block_size=4, num_kv_blocks=512,
                  max_num_batched_tokens=16, tensor_parallel_size=world)
        try:
            outs.append(llm.generate(prompts(), params, use_tqdm=False))
        finally:
            llm.engine.core.shutdown()
    for one, two in zip(*outs):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        assert len(two.prompt_logprobs) == len(one.prompt_logprobs) == len(one.prompt_token_ids)
        for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            np.testing.assert_allclose([x.logprob for x in b.values()], [x.logprob for x in a.values()], atol=1e-5)


def test_vocabulary_slices_cover_every_token_once():
    vocab, hidden = 11, 3  # not a multiple of the world size: the last slice is padded
    weight = np.arange(vocab * hidden, dtype=np.float32).reshape(vocab, hidden)
    ids = np.arange(vocab)
    total = np.zeros((vocab, hidden), dtype=np.float32)
    for rank in range(3):
        tp = TensorParallel(rank, 3)
        part = tp.vocab_part(weight, lookup_row=True)
        assert part.shape == (4 + 1, hidden) and not part[-1].any()
        total += part[tp.local_token_ids(ids.copy(), vocab)]  # what the embedding's all-reduce sums
    np.testing.assert_array_equal(total, weight)


def test_a_model_that_does_not_split_is_refused_before_workers_start(tmp_path):
    model_dir = checkpoints.make_llama(tmp_path, num_key_value_heads=1)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2 must divide the model's key-value heads \(1\)"):
        LLM(model=str(model_dir), device="cpu", max_model_len=128, num_kv_blocks=64, tensor_parallel_size=2)


@pytest.mark.parametrize("when", ["between steps", "during a step"])
def test_a_rank_that_dies_is_reported_not_waited_for(tmp_path, when):
    model_dir = checkpoints.make_llama(tmp_path)
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent(f"""
        import threading, time
        from fd_core import LLM, SamplingParams
        from fd_core.errors import BackendError
        llm = LLM(model={str(model_dir)!r}, device="cpu", max_model_len=128, num_kv_blocks=512,
                  tensor_parallel_size=2)
        rank1 = llm.engine.core.executor.workers._procs[1]
        if {when!r} == "between steps":
            rank1.kill()
            rank1.wait()
        else:  # rank 0 is then left inside a collective that rank 1 never joins
            threading.Timer(1.0, rank1.kill).start()
        started = time.monotonic()
        try:
            llm.generate([[5, 6, 7]] * 8, SamplingParams(max_tokens=100000, ignore_eos=True), use_tqdm=False)
        except BackendError as e:
            print("RAISED", e, flush=True)
        llm.engine.core.shutdown()
        print("ALL RANKS GONE", all(p.poll() is not None for p in llm.engine.core.executor.workers._procs))
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "RAISED tensor-parallel rank 1 exited with code -9" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ALL RANKS GONE True" in run.stdout


def test_a_survivors_error_seen_before_the_dead_ranks_exit_still_names_the_dead_rank():
    # A killed rank's sockets close before its exit can be reaped, so rank 0's "peer closed"
    # error can reach the engine while rank 1 still polls as running.
    class Dying:
        def __init__(self, polls_alive: int | None) -> None:
            self.polls_alive, self.returncode = polls_alive, None

        def poll(self) -> int | None:
            if self.polls_alive is None:
                return None
            if self.polls_alive == 0:
                self.returncode = -9
                return -9
            self.polls_alive -= 1
            return None

    ctx = zmq.Context()
    workers = Workers.__new__(Workers)
    workers.world_size = 2
    workers._procs = [Dying(None), Dying(3)]
    workers._replies = ctx.socket(zmq.PULL)
    workers._replies.bind("inproc://replies")
    push = ctx.socket(zmq.PUSH)
    push.connect("inproc://replies")
    push.send(pickle.dumps((0, False, "gloo: connection closed by peer")))
    try:
        with pytest.raises(BackendError, match=r"^tensor-parallel rank 1 exited with code -9$"):
            workers.wait(timeout=5)
    finally:
        push.close(linger=0)
        workers._replies.close(linger=0)
        ctx.term()


def test_an_embedding_older_than_1_17_is_refused_with_ranks(tmp_path):
    """A rank maps token ids to its embedding rows through an int64 table (API 1.17): an
    embedding op written before that stops the load naming the flag, the op and the version."""
    from fd_core.engine.config import EngineConfig
    from fd_core.engine.loading import load_runner
    from fd_core.plugins import get_registry
    from fd_core.runtimes.torch.ops import REFERENCE_OPS

    model_dir = checkpoints.make_llama(tmp_path)
    registry = get_registry(refresh=True)
    try:
        with registry.ops.registering("fd-backend-oldembed", api="1.16"):
            registry.ops.register("embedding", "cpu", REFERENCE_OPS["embedding"], name="old-embedding",
                                  priority=10, runtime="torch")
        config = EngineConfig(model=str(model_dir), device="cpu", runtime="torch", dtype="float32",
                              max_model_len=128, num_kv_blocks=64)
        config.validate()
        platform = registry.platform("cpu", "torch")
        assert load_runner(config, platform, registry).model.vocab_rows is None  # one rank: no table
        with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2: on the .* backend its embedding op "
                                              r"\(old-embedding, from fd-backend-oldembed\) was written for plugin "
                                              r"API 1.16, before 1.17"):
            load_runner(config, platform, registry, rank=0, world_size=2)
    finally:
        get_registry(refresh=True)
