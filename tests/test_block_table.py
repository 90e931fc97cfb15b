"""Device-resident block tables: rows rewritten only when a block list changes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.block_table import BlockTables


def test_rows_edits_and_one_copy_per_changed_row():
    t = BlockTables(max_blocks_per_seq=8, device=torch.device("cpu"), initial_rows=2)
    a = t.add([3, 4])
    b = t.add([9])
    t.sync()
    assert t.num_row_copies == 2
    t.sync()  # nothing changed: nothing copied
    assert t.num_row_copies == 2
    t.set(a, 2, [5])  # rollover: append
    t.set(b, 0, [11])  # copy-on-write of the last block: replace
    t.sync()
    assert t.num_row_copies == 4
    got = t.gather(np.array([b, a]), 3)
    assert got.tolist() == [[11, 0, 0], [3, 4, 5]]
    assert got.dtype == torch.int32
    assert t.num_blocks[a] == 3 and t.num_blocks[b] == 1


def test_growth_keeps_rows_and_release_reuses():
    t = BlockTables(max_blocks_per_seq=4, device=torch.device("cpu"), initial_rows=1)
    rows = [t.add([i, i + 1]) for i in range(5)]
    assert t.num_rows >= 5 and len(set(rows)) == 5
    assert t.gather(np.array(rows), 2).tolist() == [[i, i + 1] for i in range(5)]
    t.release(rows[2])
    assert t.add([42]) == rows[2]
    with pytest.raises(ValueError, match="at most 4"):
        t.set(rows[0], 2, [1, 2, 3])
    with pytest.raises(ValueError, match="gap"):
        t.set(rows[1], 3, [7])


def test_check_edit_and_a_rejected_add_takes_no_row():
    t = BlockTables(max_blocks_per_seq=4, device=torch.device("cpu"), initial_rows=1)
    t.check_edit(2, 2, 2)  # append to the end: fine
    t.check_edit(2, 1, 1)  # copy-on-write of the last block: fine
    with pytest.raises(ValueError, match="edit at -1 leaves a gap after 2 blocks"):
        t.check_edit(2, -1, 1)
    with pytest.raises(ValueError, match="edit at 3 leaves a gap after 2 blocks"):
        t.check_edit(2, 3, 1)
    with pytest.raises(ValueError, match="a sequence needs 5 blocks; at most 4 fit"):
        t.add([0] * 5)
    assert t.add([1]) == 0 and t.num_rows == 1  # the rejected add neither took nor grew a row
    with pytest.raises(ValueError, match="gap"):
        t.set(0, -1, [2])
    assert t.num_blocks[0] == 1 and t.host[0, 0] == 1
