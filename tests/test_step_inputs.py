"""``ragged_inputs``: a step's positions, slot mapping and attention metadata, against a loop
over its tokens, for decode steps (one token a sequence, the shortcut) and mixed ones."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.engine.model_runner import ragged_inputs


def reference(tables, context_lens, query_lens, block_size):
    positions, slots = [], []
    for table, ctx, q in zip(tables, context_lens, query_lens):
        for pos in range(ctx, ctx + q):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return np.array(positions, dtype=np.int64), np.array(slots, dtype=np.int64)


@pytest.mark.parametrize("query_lens", [[1], [1, 1, 1, 1], [3, 1, 1], [1, 7, 1, 2], [1, 1, 2, 0, 1]])
def test_ragged_inputs_match_a_loop_over_the_tokens(query_lens):
    rng = np.random.default_rng(len(query_lens))
    block_size = 4
    query_lens = np.array(query_lens, dtype=np.int64)
    context_lens = rng.integers(0, 30, len(query_lens)).astype(np.int64)
    width = int(((context_lens + query_lens) // block_size).max()) + 1
    tables = rng.permutation(200)[: len(query_lens) * width].reshape(len(query_lens), width).astype(np.int64)
    ids = rng.integers(0, 100, int(query_lens.sum())).astype(np.int64)
    got = ragged_inputs(ids, tables, context_lens, query_lens, block_size)
    positions, slots = reference(tables, context_lens, query_lens, block_size)
    np.testing.assert_array_equal(got.positions, positions)
    np.testing.assert_array_equal(got.meta.slot_mapping, slots)
    np.testing.assert_array_equal(got.meta.query_start_loc, np.concatenate([[0], np.cumsum(query_lens)]))
    np.testing.assert_array_equal(got.meta.seq_lens, context_lens + query_lens)
    assert got.positions is not got.meta.context_lens and not np.shares_memory(got.positions, context_lens)
