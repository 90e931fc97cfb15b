"""Scheduler configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching policy. Validated once; passed whole.

    ``max_num_batched_tokens`` is the token budget of one step (prefill chunks plus decodes);
    ``max_num_seqs`` caps how many sequences run at once; ``max_model_len`` is the longest
    sequence (prompt + output) the engine accepts. ``prefill_pacing_steps`` > 0 caps the prompt
    tokens of a step while sequences decode at 1/N of those not yet computed (at least 16;
    ``Scheduler._prefill_allowance``); 0 leaves prompts whatever the budget leaves.
    """

    max_model_len: int
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    max_queued_requests: int = 1024
    prefill_pacing_steps: int = 0

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.prefill_pacing_steps < 0:
            raise ValueError(f"prefill_pacing_steps must be >= 0, got {self.prefill_pacing_steps}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
