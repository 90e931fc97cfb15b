"""Per-sequence block tables resident on the device.

Each sequence the worker holds owns one row of a persistent ``[rows, max_blocks_per_seq]``
int32 table. A row is rewritten only when its block list changes (a new sequence, rollover,
copy-on-write); all rows changed in a step reach the device in one pinned, non-blocking
host-to-device copy. A host mirror serves slot-mapping arithmetic without device reads. On
CPU the device table *is* the host mirror (shared memory), so nothing is copied at all.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    def __init__(self, max_blocks_per_seq: int, device: torch.device, initial_rows: int = 64):
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = torch.device(device)
        self._alloc(initial_rows)
        self._free_rows = list(range(initial_rows - 1, -1, -1))
        self._dirty: set[int] = set()
        self.num_row_copies = 0  # rows copied to the device so far (observability, tests)

    def _alloc(self, rows: int, old_host: np.ndarray | None = None, old_lens: np.ndarray | None = None) -> None:
        self.host = np.zeros((rows, self.max_blocks_per_seq), dtype=np.int32)  # [rows, max_blocks]
        self.num_blocks = np.zeros(rows, dtype=np.int64)  # [rows] valid entries per row
        if old_host is not None:
            self.host[: len(old_host)] = old_host
            self.num_blocks[: len(old_lens)] = old_lens
        if self.device.type == "cpu":
            self.table = torch.from_numpy(self.host)  # shares memory with the host mirror
        else:
            self.table = torch.from_numpy(self.host).to(self.device)

    @property
    def num_rows(self) -> int:
        return self.host.shape[0]

    def add(self, block_ids: list[int]) -> int:
        """A row for a new sequence holding ``block_ids``."""
        self.check_edit(0, 0, len(block_ids))  # before taking a row: a rejected table leaks none
        if not self._free_rows:
            old_rows = self.num_rows
            self._alloc(old_rows * 2, self.host, self.num_blocks)  # rare: the device copy is whole
            self._free_rows = list(range(self.num_rows - 1, old_rows - 1, -1))
        row = self._free_rows.pop()
        self.set(row, 0, block_ids)
        return row

    def check_edit(self, num_held: int, start: int, num_ids: int) -> None:
        """Raise ``ValueError`` unless writing ``num_ids`` entries from ``start`` into a row that
        holds ``num_held`` leaves no gap and fits the row."""
        end = start + num_ids
        if not 0 <= start <= num_held:
            raise ValueError(f"block table edit at {start} leaves a gap after {num_held} blocks")
        if end > self.max_blocks_per_seq:
            raise ValueError(f"a sequence needs {end} blocks; at most {self.max_blocks_per_seq} fit the model length")

    def release(self, row: int) -> None:
        self.num_blocks[row] = 0
        self._dirty.discard(row)
        self._free_rows.append(row)

    def set(self, row: int, start: int, block_ids: list[int]) -> None:
        """Rewrite the row from ``start`` with ``block_ids`` (entries after them are dropped)."""
        end = start + len(block_ids)
        self.check_edit(int(self.num_blocks[row]), start, len(block_ids))
        self.host[row, start:end] = block_ids
        self.num_blocks[row] = end
        self._dirty.add(row)

    def sync(self) -> None:
        """Bring the device table up to date: one host-to-device copy for all changed rows."""
        if not self._dirty:
            return
        if self.device.type != "cpu":
            rows = np.fromiter(sorted(self._dirty), dtype=np.int64)
            data = torch.from_numpy(self.host[rows]).pin_memory()
            index = torch.from_numpy(rows).pin_memory()
            self.table.index_copy_(
                0, index.to(self.device, non_blocking=True), data.to(self.device, non_blocking=True)
            )
        self.num_row_copies += len(self._dirty)
        self._dirty.clear()

    def gather(self, rows: np.ndarray, num_cols: int, index: torch.Tensor | None = None) -> torch.Tensor:
        """[len(rows), num_cols] int32 on the device: the step's block tables, in batch order.
        ``index``: ``rows`` already on the device (int64), when the caller copied them."""
        if index is None:
            index = torch.from_numpy(rows)
            if self.device.type != "cpu":
                index = index.pin_memory().to(self.device, non_blocking=True)
        return self.table.index_select(0, index)[:, :num_cols]
