"""What attention needs to know about one flattened step, apart from the tensors it attends over.

Its own module so that the attention implementations (``kvcache.paged``'s dispatch and torch
reference, the Triton kernels) all import it from below and none imports another's module for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one flattened step. T = total scheduled tokens, S = sequences."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for every scheduled token's K/V
    query_start_loc: torch.Tensor  # [S+1] int32 cumulative query lengths (cu_seqlens), on the model device
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence AFTER this step (cached + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32, rows padded with 0
    max_query_len: int
    max_seq_len: int
    # host-side copies (python lists) so the CPU reference can plan without device syncs:
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    logits_indices: torch.Tensor  # [num_sampled] int64: indices into the T tokens whose hidden state gets logits
