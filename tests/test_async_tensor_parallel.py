"""Asynchronous scheduling with two tensor-parallel ranks (gloo on the CPU): every rank samples
the gathered logits and feeds the next step's ids from its own sample, and the engine reads
rank 0's tokens after queuing that next step. The outputs must be the synchronous engine's.

On the CPU no op is asynchronous, so the cpu backend leaves ``sample_async`` out. The ranks are
processes of their own, which see only installed plugins: the test installs one (a
distribution on ``PYTHONPATH``) whose ``sample_async`` is the reference sample handed back as a
PendingSample that scatters on the host, logging each feed with its process id, and runs the
engines in a child process that sees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")  # the checkpoint is built with transformers

from tests import checkpoints  # noqa: E402
from tests.plugins import fake_dists  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

HOST_FED = """
    from fd_core.plugins import hookimpl
    from tests.plugins.host_fed import sampler

    FD_API_VERSION = "1.17"


    @hookimpl
    def fd_register_ops(registry):
        for runtime in ("paddle", "torch"):
            registry.register("sample_async", "cpu", sampler(runtime), name="host-fed", runtime=runtime)
"""

RUN = """
import json, os, sys
from fd_core import LLM
from tests.test_async_scheduling import MIXED, prompts

model, settings = sys.argv[1], json.loads(sys.argv[2])
params = MIXED * 2  # greedy, seeded with logprobs, forks, penalties, prompt logprobs
out = {}
for name, engine_args in settings.items():
    for async_scheduling in (False, True):
        # the asynchronous engine is the default one: on with ranks where the backend can launch
        args = dict(engine_args)
        if not async_scheduling:  # rounds of decode steps need it: the synchronous engine runs step by step
            args.pop("num_scheduler_steps", None)
        llm = LLM(model=model, device="cpu", max_model_len=128, block_size=4, tensor_parallel_size=2,
                  async_scheduling=None if async_scheduling else False, **args)
        core = llm.engine.core
        assert core.async_scheduling == async_scheduling and core.executor.workers.world_size == 2
        results = llm.generate(prompts(10), params, use_tqdm=False)
        assert core.pool.num_free == core.pool.capacity and not core.has_unfinished_requests()
        out[f"{name}/{async_scheduling}"] = {
            "steps": core.stats["steps"],
            "rounds": core.stats["rounds"],
            "preemptions": core.stats["preemptions"],
            "texts": [[(list(c.token_ids), c.finish_reason, c.cumulative_logprob) for c in r.outputs]
                      for r in results],
            "prompt_logprobs": [[None if p is None else sorted((t, x.logprob) for t, x in p.items())
                                 for p in (r.prompt_logprobs or [])] for r in results],
        }
        core.shutdown()
out["pid"] = os.getpid()
print(json.dumps(out))
"""

SETTINGS = {
    "chunked": {"num_kv_blocks": 512, "max_num_batched_tokens": 7},  # decodes beside prompt chunks
    "preempt-swap": {"num_kv_blocks": 4 * 12 + 1, "swap_space": 0.01},
    # rounds of decode steps (engine/rounds.py): each rank keeps the samples of two rounds
    "rounds": {"num_kv_blocks": 512, "num_scheduler_steps": 4},
}


def test_two_ranks_with_async_scheduling_give_the_synchronous_outputs(tmp_path):
    site = tmp_path / "site"
    fake_dists.install(site, "fd-backend-hostfed", "fd_backend_hostfed", HOST_FED, "hostfed")
    model_dir = checkpoints.make_llama(tmp_path / "model")
    feeds = tmp_path / "feeds.log"
    env = dict(os.environ, FD_TEST_FEEDS=str(feeds), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", RUN, str(model_dir), json.dumps(SETTINGS)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name in SETTINGS:
        sync, overlapped = got[f"{name}/False"], got[f"{name}/True"]
        assert [[c[:2] for c in r] for r in overlapped["texts"]] == [[c[:2] for c in r] for r in sync["texts"]], name
        # a sequence that stopped still fills a row of the step queued after its last token, so
        # the batches differ and float32 sums may round differently
        np.testing.assert_allclose([c[2] for r in overlapped["texts"] for c in r],
                                   [c[2] for r in sync["texts"] for c in r], rtol=1e-5)
        for a, b in zip(sync["prompt_logprobs"], overlapped["prompt_logprobs"]):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert (x is None) == (y is None)
                if x is not None:
                    assert [t for t, _ in x] == [t for t, _ in y]
                    np.testing.assert_allclose([v for _, v in y], [v for _, v in x], rtol=1e-5, atol=1e-6)
    assert got["preempt-swap/True"]["preemptions"] > 0  # the tight cache did preempt
    assert got["rounds/True"]["rounds"] > 0
    # both ranks of each asynchronous engine fed steps from their own samples; the engine's
    # process fed none
    pids = set(feeds.read_text().split())
    assert len(pids) == 2 * len(SETTINGS) and str(got["pid"]) not in pids
