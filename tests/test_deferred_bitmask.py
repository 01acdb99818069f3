"""The kit's case for the optional ``deferred_bitmask`` op (API 1.12), on the CPU with the
emulated device of ``tests.test_async_scheduling`` (a sample that runs when its tokens are
asked for, after the mask's ``ready()``): it passes such a backend and names the two ways to
get it wrong, reading the mask when the sample is queued and waiting for ``ready()``."""

from __future__ import annotations

import dataclasses

import pytest

from fd_core.interfaces import Capabilities
from fd_core.runtimes.paddle.memory import PaddleMemory
from fd_core.runtimes.paddle.ops import REFERENCE_OPS
from fd_core.testing import opcases
from fd_core.testing.opcases import OpMismatch
from tests.test_async_scheduling import HostFed, HostGate, LateSample

CASE = next(c for c in opcases.cases(Capabilities(dtypes=frozenset({"float32"})), {"deferred_bitmask"}))
SAMPLE = REFERENCE_OPS["sample"]


def test_a_mask_read_after_ready_passes():
    opcases.run_case(CASE, HostGate, PaddleMemory("cpu"), "host-gate",
                     sample_async=lambda logits, batch: LateSample(SAMPLE, logits, batch))


def test_a_mask_read_when_the_sample_is_queued_fails():
    def early(logits, batch):
        mask = batch.allowed_token_bitmask
        if isinstance(mask, HostGate):
            batch = dataclasses.replace(batch, allowed_token_bitmask=mask.array.copy())
        return HostFed(SAMPLE(logits, batch))

    with pytest.raises(OpMismatch, match="token_ids"):
        opcases.run_case(CASE, HostGate, PaddleMemory("cpu"), "early", sample_async=early)


def test_a_sample_that_waits_for_ready_fails(monkeypatch):
    monkeypatch.setattr(opcases, "DEFERRED_PATIENCE", 0.3)

    def waits(logits, batch):
        late = LateSample(SAMPLE, logits, batch)
        late.result()
        return late

    with pytest.raises(OpMismatch, match="waited for the deferred bitmask"):
        opcases.run_case(CASE, HostGate, PaddleMemory("cpu"), "waits", sample_async=waits)


def test_the_array_must_be_the_batch_shape():
    with pytest.raises(OpMismatch, match=r"int32 \[8, 32\]"):
        opcases.run_case(CASE, lambda rows, words: HostGate(rows, words + 1), PaddleMemory("cpu"), "wide",
                         sample_async=lambda logits, batch: LateSample(SAMPLE, logits, batch))
