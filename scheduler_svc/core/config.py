"""Scheduler configuration: the batching policy's view of the settings (``pagewire_common.settings``)."""

from __future__ import annotations

from dataclasses import dataclass

from pagewire_common.settings import Settings, check_all, default_of


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batching policy. Validated once; passed whole. Defaults and checks are the settings'.

    ``max_num_batched_tokens`` is the token budget of one step (prefill chunks plus decodes);
    ``max_num_seqs`` caps how many sequences run at once; ``max_model_len`` is the longest
    sequence (prompt + output) the engine accepts. ``prefill_pacing_steps`` > 0 caps the prompt
    tokens of a step while sequences decode at 1/N of those not yet computed (at least 16;
    ``Scheduler._prefill_allowance``); 0 leaves prompts whatever the budget leaves.
    """

    max_model_len: int
    max_num_batched_tokens: int = default_of("max_num_batched_tokens")
    max_num_seqs: int = default_of("max_num_seqs")
    enable_prefix_caching: bool = default_of("enable_prefix_caching")
    max_queued_requests: int = default_of("max_queued_requests")
    prefill_pacing_steps: int = default_of("prefill_pacing_steps")

    def __post_init__(self) -> None:
        check_all(self, ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "max_queued_requests",
                         "prefill_pacing_steps"))

    @classmethod
    def from_settings(cls, settings: Settings, max_model_len: int) -> "SchedulerConfig":
        """The policy for a worker whose model length is ``max_model_len`` (capped by
        ``--max-model-len`` when given)."""
        return cls(
            max_model_len=min(settings.max_model_len or max_model_len, max_model_len),
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            enable_prefix_caching=settings.enable_prefix_caching,
            max_queued_requests=settings.max_queued_requests,
            prefill_pacing_steps=settings.prefill_pacing_steps,
        )
