"""Proposers with a model of their own: a smaller draft model (``draft_model``) or the target
checkpoint's MTP layer (``mtp``). Their keys and values live in the target's blocks, in cache
layers of their own (``ModelRunner.proposer_caches``), so the block table, the prefix cache,
forks, swapping and preemption cover them as they cover the target's.

After each step the proposer model computes what it has not yet (``Sequence.proposer_computed``
up to where the step left the sequence), in one forward over all scheduled sequences — a prompt's
chunks as the target computed them, a decoding sequence's accepted tokens — and each decoding
sequence's first draft comes from its last row; one pass of one token per sequence follows for
each further draft (``ModelRunner.propose``). The passes write keys and values for the drafts at
positions past ``proposer_computed``: the next catch-up writes them again where the drafts were
not accepted.

- The draft model reads tokens: its catch-up runs through the newest token (which the target
  computes only in the next step), so its last row predicts the first draft.
- The MTP layer at position ``p`` reads the target's hidden state there and the token at ``p + 1``
  (``fd_core/models/mtp.py``): its catch-up covers the positions the target computed and
  accepted in this step, whose hidden states the runner kept, and its last row predicts the
  token after the newest. Its cache at a block's last position depends on the token after the
  block, which a later sequence sharing the block through the prefix cache may not have: its
  first draft there may then be worse, never its output (drafts are verified).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fd_core.engine.block_pool import BlockPool
from fd_core.engine.model_runner import ProposalPlan, ragged_inputs
from fd_core.engine.scheduler import ScheduledSeq
from fd_core.engine.sequence import Sequence
from fd_core.engine.speculative.config import SpeculativeConfig
from fd_core.engine.speculative.proposer import room, wants_drafts


class ModelProposer:
    holds_kv = True

    def __init__(self, config: SpeculativeConfig, max_model_len: int, pool: BlockPool,
                 run: Callable[[ProposalPlan], np.ndarray], reserve: Callable[[], int]) -> None:
        """``run``: the executor's ``propose`` (every rank runs the plan); ``reserve``: free
        blocks to leave for the next step (the running sequences' own next tokens), which the
        drafts' slots never take."""
        self.k = config.num_speculative_tokens
        self.mtp = config.method == "mtp"
        self.max_model_len = max_model_len
        self.pool, self.run, self.reserve = pool, run, reserve

    def propose(self, scheduled: list[ScheduledSeq], decoding: list[Sequence]) -> None:
        block_size = self.pool.block_size
        spare = self.pool.num_free - self.reserve()
        wanted = {id(seq) for seq in decoding}
        ids: list[int] = []
        tables, starts, counts, hidden_rows = [], [], [], []
        drafting: list[tuple[Sequence, int, int, int]] = []  # (sequence, its table, its last row, drafts)
        row = 0  # the step's rows: each scheduled sequence's tokens in order
        total = 0  # the catch-up's tokens so far
        for s in scheduled:
            seq = s.seq
            first_row, row = row, row + s.num_new
            computed = seq.num_computed + s.num_new - s.rejected  # the step's tokens, accepted
            decodes = id(seq) in wanted
            start = seq.proposer_computed
            if self.mtp:
                start = max(start, seq.num_computed)  # hidden states exist for this step's positions only
                end = computed
            else:
                end = seq.num_tokens if decodes else computed
                if end > len(seq.block_table) * block_size:  # the newest token's slot needs a block
                    if spare < 1:
                        end, decodes = computed, False
                    else:
                        self.pool.grow(seq, end)
                        spare -= 1
            if end <= start:
                continue
            k = room(seq, self.k, self.max_model_len) if decodes and wants_drafts(seq) else 0
            if k > 1:  # the passes after the first draft write slots up to end + k - 2
                fit = (len(seq.block_table) + max(0, spare)) * block_size - end + 1
                k = max(1, min(k, fit))
                need = self.pool.blocks_needed(seq, end + k - 1)
                self.pool.grow(seq, end + k - 1)
                spare -= need
            if self.mtp:
                ids += seq.tokens_between(start + 1, end + 1)
                hidden_rows.append(first_row + start - seq.num_computed + np.arange(end - start))
            else:
                ids += seq.tokens_between(start, end)
            tables.append(seq.block_table)
            starts.append(start)
            counts.append(end - start)
            total += end - start
            seq.proposer_computed = end
            if k:
                drafting.append((seq, len(tables) - 1, total - 1, k))
        if not counts:
            return
        inputs = ragged_inputs(np.asarray(ids, dtype=np.int64), tables, np.asarray(starts, dtype=np.int64),
                               np.asarray(counts, dtype=np.int64), block_size)
        inputs.logit_rows = np.array([r for _, _, r, _ in drafting], dtype=np.int64)
        plan = ProposalPlan(
            inputs=inputs,
            num_drafts=np.array([k for *_, k in drafting], dtype=np.int64),
            block_tables=inputs.meta.block_tables[[t for _, t, _, _ in drafting]],
            last_positions=inputs.positions[inputs.logit_rows],
            hidden_rows=np.concatenate(hidden_rows) if self.mtp else None,
        )
        drafts = self.run(plan)
        for (seq, _, _, k), tokens in zip(drafting, drafts.tolist()):
            seq.draft_token_ids = tokens[:k]

