"""The vocabulary split over the tensor-parallel ranks: the input embedding and the output head.

Rank r holds rows ``[r * n, (r + 1) * n)`` of the [vocab, hidden] table, n = ceil(vocab / N);
the last rank's rows past the vocabulary are zeros. The embedding looks up the ids in its range,
zeroes the rest and sums over the ranks (one all-reduce); the head computes this rank's logits
of the rows that sample and gathers them on rank 0 only (the one rank that samples).
With one rank these are a plain embedding and a plain linear head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.sources import WeightSource
from worker_svc.parallel.group import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Module):
    """ids [T] -> [T, hidden]."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows_per_rank
        self.num_rows = max(0, min(self.rows_per_rank, num_embeddings - self.start))  # real (unpadded) rows
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim))
        # the dtype of the hidden states it returns; None: the table's. A bf16 table on a CPU
        # without native bf16 returns fp32 (worker_svc.cpu.bf16_linear).
        self.output_dtype: torch.dtype | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight).to(self.output_dtype or self.weight.dtype)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight).to(self.output_dtype or self.weight.dtype)  # [T, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)

    def load_shard(self, param_name: str, shard: int, source: WeightSource) -> None:
        expected = (self.num_embeddings, self.weight.shape[1])
        if tuple(source.shape) != expected:
            raise ValueError(f"shape mismatch for {param_name}: checkpoint {tuple(source.shape)}, expected {expected}")
        weight = self.weight.data
        weight[: self.num_rows].copy_(source.narrow(0, self.start, self.num_rows))
        weight[self.num_rows :].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """The output head's weight, sharded like the embedding; ``CausalLM.compute_logits`` uses it
    (or, tied, the embedding's own shard)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError("use CausalLM.compute_logits")
