"""A step's arrays staged for the device (``worker_svc.step_io``): each at an aligned offset of one
buffer (Triton compiles a kernel variant per 16-byte alignment of its pointer arguments, and the
worker compiles only the aligned ones at start), values and dtypes as given."""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.cuda_graphs import DecodeGraphs
from worker_svc.step_io import ALIGN, HostToDevice, Section, layout


def test_sections_are_laid_out_aligned_one_after_another():
    sections = [Section(np.arange(n, dtype=np.int64), dtype) for n, dtype in
                ((3, torch.int64), (5, torch.int32), (1, torch.int64), (7, torch.int32))]
    end = layout(sections, start=8)
    offsets = [s.offset for s in sections]
    assert all(o % ALIGN == 0 and o % 16 == 0 for o in offsets) and offsets == sorted(offsets)
    assert offsets[0] >= 8 and end == offsets[-1] + 7 * 4
    for a, b in zip(sections, sections[1:]):  # no overlap
        assert a.offset + a.array.size * torch.empty((), dtype=a.dtype).element_size() <= b.offset


def test_staged_into_a_destination_views_keep_values_dtypes_and_alignment():
    dest = torch.zeros(4096, dtype=torch.uint8)
    arrays = [(np.array([5, -1, 7], dtype=np.int64), torch.int64), (np.array([1, 2, 3, 4, 5], dtype=np.int64), torch.int32),
              (np.array([9], dtype=np.int64), torch.int64)]
    staged = HostToDevice(torch.device("cpu")).stage([Section(a, d) for a, d in arrays], dest=dest)
    for (array, dtype), t in zip(arrays, staged):
        assert t.dtype == dtype and t.tolist() == array.tolist()
        assert (t.data_ptr() - dest.data_ptr()) % ALIGN == 0


def test_decode_graph_static_inputs_are_aligned_for_any_batch():
    for max_batch in (1, 3, 5, 7, 256):
        graphs = DecodeGraphs(None, None, max_batch, 64, 4, torch.device("cpu"), capture=False)
        base = graphs.inputs.data_ptr()
        for t in (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.seq_lens):
            assert (t.data_ptr() - base) % ALIGN == 0 and t.numel() == graphs.max_batch
        assert graphs.static_end % ALIGN == 0 and graphs.slot_mapping.eq(-1).all() and graphs.seq_lens.eq(1).all()
        # what a step stages after them (rows, and ids from the device: 24 bytes a row) fits
        extra = [Section(np.zeros(graphs.max_batch, dtype=np.int64), torch.int64) for _ in range(3)]
        assert layout(extra, graphs.static_end) <= graphs.inputs.numel()
