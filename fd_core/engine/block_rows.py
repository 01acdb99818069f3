"""The running sequences' block tables as rows of one host array, kept from step to step.

Building a step's ``[sequences, blocks]`` table from each sequence's Python list copied every
block of every sequence, every step: 115 us of the 193 us ``prepare_inputs`` took for 128
decodes of 70 blocks (2-core EPYC host), and it grows with the context (2,048 blocks a sequence
at 32K tokens). Here each sequence owns a row that is written when its table is new and
appended to when it grows, so a decode step writes only the blocks it added; the step's table
is then one gather of the rows.

It relies on ``Sequence.block_table``'s rule: a table is only ever extended in place; any other
change (admission, a fork, a swap-in, freeing, dropping rejected drafts' blocks) assigns a new
list. A row is trusted while its sequence still holds the very list it was written from, and
the blocks past the length it had then are the ones appended since.
"""

from __future__ import annotations

import numpy as np

from fd_core.engine.sequence import Sequence


class BlockTableRows:
    def __init__(self) -> None:
        # every row holds zeros past the blocks written into it
        self._rows = np.zeros((16, 64), dtype=np.int64)
        # seq_id -> [the list its row was written from, how much of it is written, its row]
        self._held: dict[int, list] = {}
        self._free: list[int] = []
        self._used = 0  # rows handed out so far (free ones included)

    def tables(self, seqs: list[Sequence]) -> np.ndarray:
        """``[len(seqs), max blocks]`` int64: row ``i`` holds ``seqs[i].block_table``, zeros after
        it (a fresh array: a step in flight keeps its own)."""
        rows = np.empty(len(seqs), dtype=np.int64)
        width = 0
        held_by = self._held
        for i, seq in enumerate(seqs):
            table = seq.block_table
            n = len(table)
            if n > width:
                width = n
            held = held_by.get(seq.seq_id)
            if held is None:
                held = held_by[seq.seq_id] = [table, 0, self._take()]
            elif held[0] is not table or held[1] > n:  # a new list: written whole
                self._rows[held[2], : held[1]] = 0
                held[0], held[1] = table, 0
            if held[1] < n:
                if n > self._rows.shape[1]:
                    self._widen(n)
                self._rows[held[2], held[1] : n] = table[held[1] :]
                held[1] = n
            rows[i] = held[2]
        if len(held_by) > 2 * len(seqs) + 64:
            self._release_all_but(seqs)
        return self._rows[rows, :width]

    def _release_all_but(self, seqs: list[Sequence]) -> None:
        """Give back the rows of sequences not in this step (finished ones, mostly; one that
        comes back gets a new row, written whole)."""
        keep = {seq.seq_id for seq in seqs}
        for seq_id in [s for s in self._held if s not in keep]:
            _, written, row = self._held.pop(seq_id)
            self._rows[row, :written] = 0
            self._free.append(row)

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        row = self._used
        self._used += 1
        if row >= self._rows.shape[0]:
            grown = np.zeros((2 * self._rows.shape[0], self._rows.shape[1]), dtype=np.int64)
            grown[: self._rows.shape[0]] = self._rows
            self._rows = grown
        return row

    def _widen(self, width: int) -> None:
        grown = np.zeros((self._rows.shape[0], max(width, 2 * self._rows.shape[1])), dtype=np.int64)
        grown[:, : self._rows.shape[1]] = self._rows
        self._rows = grown

    def __len__(self) -> int:
        """Sequences holding a row."""
        return len(self._held)
