"""A decode graph's inputs moved one position further on the device, for the next step of a
round (``--num-scheduler-steps``, plugin API 1.21's ``advance_sample``): each sequence's input
token becomes the one the graph just drew, its position, lengths and cache slot one further,
and its sampling step index one further (a seeded row draws the next step's noise).

Why: the host built, uploaded and fed each of a round's later steps like any other (the step's
ids, positions, lengths, slots, block tables and sampling parameters: five copies and two index
kernels a step, ~0.3 ms of the H200 host's time at 128 sequences, longer than the GPU's step
once the host was the bound). One launch here replaces them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 128


@triton.jit
def _advance_kernel(ids_ptr, positions_ptr, lens_ptr, tables_ptr, params_ptr, drawn_ptr, S, N, stride_table,
                    stride_params, stride_drawn, BLOCK_SIZE: tl.constexpr, STEP_COLUMN: tl.constexpr,
                    BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < S
    tl.store(ids_ptr + i, tl.load(drawn_ptr + i * stride_drawn, mask=ok), mask=ok)
    position = tl.load(positions_ptr + i, mask=ok) + 1
    tl.store(positions_ptr + i, position, mask=ok)
    # lens: int32 seq_lens [N] | context_lens [N] | slot mapping [N] (one token a sequence)
    tl.store(lens_ptr + i, tl.load(lens_ptr + i, mask=ok) + 1, mask=ok)
    tl.store(lens_ptr + N + i, tl.load(lens_ptr + N + i, mask=ok) + 1, mask=ok)
    block = tl.load(tables_ptr + i.to(tl.int64) * stride_table + position // BLOCK_SIZE, mask=ok)
    tl.store(lens_ptr + 2 * N + i, (block * BLOCK_SIZE + position % BLOCK_SIZE).to(tl.int32), mask=ok)
    step = params_ptr + i * stride_params + STEP_COLUMN
    tl.store(step, tl.load(step, mask=ok) + 1, mask=ok)


def advance(ids: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
            params: torch.Tensor, drawn: torch.Tensor, num_seqs: int, block_size: int, step_column: int) -> None:
    """In place, for the first ``num_seqs`` rows of a decode graph of ``len(ids)`` rows:
    ``ids`` <- ``drawn[:, 0]``; ``positions``, ``seq_lens`` and ``context_lens`` (the first two
    thirds of the int32 ``lens``) + 1; the slot mapping (its last third) the new position's slot
    in ``tables`` (int32 ``[rows, blocks]``); ``params[:, step_column]`` + 1. The tables must
    already hold the block of every new position (the engine reserves a round's blocks before
    its first step)."""
    n = ids.shape[0]
    grid = (triton.cdiv(num_seqs, _BLOCK),)
    _advance_kernel[grid](ids, positions, lens, tables, params, drawn, num_seqs, n, tables.stride(0),
                          params.stride(0), drawn.stride(0), BLOCK_SIZE=block_size, STEP_COLUMN=step_column,
                          BLOCK=_BLOCK, num_warps=4)
