"""Multi-step decoding (vLLM's ``--num-scheduler-steps``): a step of decodes only runs as a
round of up to K device steps queued back to back, each taking its input tokens from the sample
of the one before on the device. The host schedules, builds the step's inputs and sampling
parameters, and reads tokens once a round instead of once a step.

Why: at a hundred or more sequences the host's per-step work (scheduling, step inputs, sampling
parameters, the launches) outlasted the GPU's step on the cuda backend, so the GPU idled between
steps (docs/PERFORMANCE.md). What it costs: a sequence that stops early in a round computes the
round's remaining steps for nothing (its extra tokens are dropped, as a step in flight's are
under asynchronous scheduling), a new request waits for the round's end, and a stream receives
its tokens in bursts of up to K.

A round never changes what is sampled: step ``j`` of a round is the step the engine would have
run ``j`` steps later (the same positions, slots, and sampling step index, so seeded rows draw
the same noise). So it runs only where nothing a row samples with depends on the tokens of the
round itself (penalties, bad words, a grammar, ``min_tokens`` not yet reached), and where no
sequence is at a turning point (forks, drafts, a prompt still computing, prompt logprobs, a
hand-over to another instance).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fd_core.engine.model_runner import PLACEHOLDER, StepInputs, ragged_inputs
from fd_core.engine.scheduler import ScheduledSeq
from fd_core.interfaces import SamplingBatch


def round_steps(scheduled: list[ScheduledSeq], limit: int, max_model_len: int) -> int:
    """How many device steps the scheduled step may run as (at most ``limit``): 1 unless every
    sequence decodes one token whose sampling reads nothing of the round's own tokens. No
    sequence's positions pass ``max_model_len``; no step follows the one where every sequence
    has reached its ``max_tokens``."""
    if limit <= 1 or not scheduled:
        return 1
    steps, longest = limit, 0
    for s in scheduled:
        seq = s.seq
        outputs = len(seq.output_token_ids)
        p = seq.params
        if (s.num_new != 1 or s.forks or s.drafts or seq.num_computed != len(seq.prompt_token_ids) + outputs - 1
                or seq.grammar is not None or seq.reads_history or seq.bad_words or seq.hand_over
                or outputs < p.min_tokens or seq.owes_prompt_logprobs):
            return 1
        # step j computes position num_tokens - 1 + j, which must stay below max_model_len
        steps = min(steps, max_model_len - len(seq.prompt_token_ids) - outputs + 1)
        longest = max(longest, seq.max_tokens - outputs)
    return max(1, min(steps, longest))


def later_inputs(first: StepInputs, j: int, block_size: int) -> StepInputs:
    """Step ``j`` of a round whose first step is ``first`` (decodes, one row each): every
    sequence one position further per step, its input token the previous step's sample
    (``PLACEHOLDER`` on the host, fed on the device)."""
    meta = first.meta
    n = len(first.input_ids)
    inputs = ragged_inputs(np.full(n, PLACEHOLDER, dtype=np.int64), meta.block_tables, meta.context_lens + j,
                           np.ones(n, dtype=np.int64), block_size)
    inputs.logit_rows = first.logit_rows
    return inputs


def later_batch(first: SamplingBatch, j: int) -> SamplingBatch:
    """``first``'s sampling parameters for step ``j`` of its round: each row's step index ``j``
    further (a seeded row's noise follows it)."""
    return dataclasses.replace(first, steps=first.steps + j)
