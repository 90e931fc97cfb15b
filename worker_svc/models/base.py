"""What every causal LM here shares: the output head and the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.config import ModelConfig
from worker_svc.layers.vocab import ParallelLMHead
from worker_svc.parallel.group import SINGLE, TensorParallel


class CausalLM(nn.Module):
    """Holds ``lm_head`` (None with tied embeddings; this rank's vocabulary rows otherwise) and
    ``packed_lm_head`` (set on CPU by ``worker_svc.cpu.linear.pack_linears_for_cpu``); subclasses say
    which weight a tied head shares."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.config = config
        self.tp = tp
        self.lm_head = None if config.tie_word_embeddings else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.packed_lm_head: nn.Module | None = None

    def tied_lm_head_weight(self) -> torch.Tensor:
        """The input embedding weight (this rank's rows) a tied head uses: [vocab / N, hidden]."""
        raise NotImplementedError

    def lm_head_weight(self) -> torch.Tensor:
        return self.tied_lm_head_weight() if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] fp32; with several ranks, on rank 0 only (None elsewhere): each
        rank computes its vocabulary rows for the N rows that sample, and rank 0 gathers them."""
        if self.packed_lm_head is not None:
            local = self.packed_lm_head(hidden)
        else:
            local = F.linear(hidden, self.lm_head_weight())
        if self.tp.size == 1:
            return local.float()
        full = self.tp.gather_last_dim(local.float())
        return None if full is None else full[:, : self.config.vocab_size]
