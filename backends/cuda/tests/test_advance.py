"""A decode graph's inputs moved on by one step on the device (``kernels/advance.py``) equal the
inputs the engine builds for a round's next step (``rounds.later_inputs``), step after step.
Runs in Triton's interpreter without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fd_core.engine.model_runner import ragged_inputs  # noqa: E402
from fd_core.engine.rounds import later_inputs  # noqa: E402

from fd_backend_cuda.kernels.advance import advance  # noqa: E402
from fd_backend_cuda.kernels.sampling import PARAM_STEP, pack_params  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("seqs, rows, block_size", [(5, 8, 4), (1, 1, 16), (130, 160, 16)])
def test_advance_makes_the_inputs_of_the_round_s_next_steps(seqs, rows, block_size):
    rng = np.random.default_rng(seqs)
    steps = 4
    context = rng.integers(0, 40, seqs)
    width = int((context.max() + steps) // block_size + 1)
    blocks = rng.permutation(seqs * width + 7)[: seqs * width].reshape(seqs, width)
    first = ragged_inputs(rng.integers(0, 1000, seqs), blocks, context, np.ones(seqs, dtype=np.int64), block_size)
    meta = first.meta
    # a graph of ``rows`` rows as graphs._Graph.replay_head leaves it: padding rows after the step's
    ids = torch.full((rows,), 7, dtype=torch.int64)
    ids[:seqs] = torch.from_numpy(first.input_ids)
    positions = torch.full((rows,), 3, dtype=torch.int64)
    positions[:seqs] = torch.from_numpy(first.positions)
    lens = torch.zeros(3 * rows, dtype=torch.int32)
    lens[:seqs] = torch.from_numpy(meta.seq_lens)
    lens[rows : rows + seqs] = torch.from_numpy(meta.context_lens)
    lens[2 * rows :] = -1
    lens[2 * rows : 2 * rows + seqs] = torch.from_numpy(meta.slot_mapping)
    tables = torch.full((rows, width + 3), -5, dtype=torch.int32)  # stale columns past the step's
    tables[:seqs, :width] = torch.from_numpy(blocks)
    base_steps = rng.integers(0, 9, rows)
    ones = np.ones(rows)
    params = torch.from_numpy(pack_params(ones, np.zeros(rows), ones, 0 * ones, rng.integers(0, 99, rows), base_steps))
    drawn = torch.zeros((rows, 4), dtype=torch.int64)
    ids, positions, lens, tables, params, drawn = (t.to(DEVICE) for t in (ids, positions, lens, tables, params, drawn))
    before = params.clone()
    padding = (ids[seqs:].clone(), positions[seqs:].clone(), lens.view(3, rows)[:, seqs:].clone(),
               params[seqs:].clone())
    for j in range(1, steps):
        tokens = torch.from_numpy(rng.integers(0, 1000, (rows, 4))).to(DEVICE)
        drawn.copy_(tokens)  # the graph's draw of the step before
        advance(ids, positions, lens, tables, params, drawn, seqs, block_size, PARAM_STEP)
        want = later_inputs(first, j, block_size)
        assert ids[:seqs].tolist() == tokens[:seqs, 0].tolist()
        assert positions[:seqs].tolist() == want.positions.tolist()
        got = lens.view(3, rows)[:, :seqs].cpu().numpy()
        assert got[0].tolist() == want.meta.seq_lens.tolist()
        assert got[1].tolist() == want.meta.context_lens.tolist()
        assert got[2].tolist() == want.meta.slot_mapping.tolist()
        assert params[:seqs, PARAM_STEP].tolist() == (base_steps[:seqs] + j).tolist()
        others = [c for c in range(params.shape[1]) if c != PARAM_STEP]
        assert torch.equal(params[:, others], before[:, others])  # temperature, top-k/p, min-p, seed
        # padding rows are left as they were
        assert torch.equal(ids[seqs:], padding[0]) and torch.equal(positions[seqs:], padding[1])
        assert torch.equal(lens.view(3, rows)[:, seqs:], padding[2]) and torch.equal(params[seqs:], padding[3])
