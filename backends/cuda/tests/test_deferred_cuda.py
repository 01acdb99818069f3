"""Deferred grammar masks on the GPU (``deferred_bitmask``, ``fd_backend_cuda/deferred.py``):
with asynchronous scheduling the engine queues each constrained step's sample behind a wait on
the device, and its grammar thread fills the mask meanwhile. The outputs must be those of the
synchronous engine, whose masks are filled before the sample. The tests' tiny random-weight
Llama in float32, greedy and seeded rows beside free ones. Needs a CUDA device."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")

from fd_core import LLM, SamplingParams  # noqa: E402
from fd_core.engine.structured import StructuredOutputsParams as S  # noqa: E402

REGEX = r"[ab]{2,5}c\d"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["x", "yy"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def outputs(model, async_scheduling: bool, monkeypatch):
    from fd_core.engine.executor import Executor

    made = []
    real = Executor.deferred_bitmask
    monkeypatch.setattr(Executor, "deferred_bitmask", lambda self, rows, words: (
        made.append(rows), real(self, rows, words))[1])
    llm = LLM(model=str(model), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16,
              gpu_memory_utilization=0.2, async_scheduling=async_scheduling)
    params = []
    for i in range(12):
        so = [S(json=SCHEMA), S(regex=REGEX), None][i % 3]
        params.append(SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=40, n=2 if i == 4 else 1,
                                     ignore_eos=so is None, structured_outputs=so))
    outs = llm.generate([f"prompt number {i} says" for i in range(12)], params, use_tqdm=False)
    llm.engine.core.shutdown()
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs], len(made)


def test_deferred_masks_give_the_synchronous_outputs(llama, monkeypatch):
    """9 constrained rows at first (one request with n=2), DEFER_ROWS (8) and more defer; the
    rows thin out as requests end, and the rest are filled on the engine's thread."""
    sync, sync_deferred = outputs(llama, False, monkeypatch)
    overlapped, deferred = outputs(llama, True, monkeypatch)
    assert deferred > 0 and sync_deferred == 0
    assert overlapped == sync
    for i, out in enumerate(overlapped):
        for tokens, reason, text in out:
            if i % 3 == 1 and reason == "stop":
                assert re.fullmatch(REGEX.replace(r"\d", "[0-9]"), text), text
            elif i % 3 == 0 and reason == "stop":
                value = json.loads(text)
                assert set(value) == {"n", "tag"}
