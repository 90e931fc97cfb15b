"""What every causal LM here shares: the output head and the logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.config import ModelConfig


class CausalLM(nn.Module):
    """Holds ``lm_head`` (None with tied embeddings) and ``packed_lm_head`` (set on CPU by
    ``layers.cpu_linear.pack_linears_for_cpu`` for tied heads); subclasses say which weight a tied
    head shares."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head: nn.Module | None = None

    def tied_lm_head_weight(self) -> torch.Tensor:
        """The input embedding weight a tied head uses: [vocab, hidden]."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] fp32."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden).float()
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.tied_lm_head_weight()).float()
