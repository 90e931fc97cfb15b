"""The step plan (scheduler -> worker) and the step result (worker -> scheduler).

A plan is a *diff* against what the worker already holds: a new sequence is sent once in full,
a running one only as the change to its block table and how many tokens to compute. These are
plain dataclasses; the gRPC layer converts them to and from protobuf at the edge.

Pure Python: the scheduler imports this and must never pull in torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagewire_common.sampling import SamplingParams


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen (or must rebuild after preemption).

    ``token_ids`` is every token known so far (the prompt, plus tokens generated before a
    preemption). The first ``num_computed_tokens`` already have K/V in ``block_ids`` (prefix
    cache hits); this step computes the next ``num_scheduled_tokens``. The first
    ``num_prompt_tokens`` of ``token_ids`` are the prompt (0: all of them). ``stop_token_ids``
    (the ids that end the sequence) are sent when ``sampling.min_tokens`` asks the worker to mask
    them.
    """

    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling: SamplingParams
    num_prompt_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class RunningSequence:
    """A step's change to a sequence the worker already holds.

    The block table is rewritten from index ``block_table_start`` with ``block_ids``: appending
    a block after rollover is ``start == len(old table)``; a copy-on-write replacement of the
    last block is ``start == len(old table) - 1``. Empty ``block_ids`` means no change.
    The input tokens are known to the worker: the rest of the prompt, or the token it sampled.
    """

    seq_id: int
    num_scheduled_tokens: int
    block_table_start: int = 0
    block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """One step for the worker. ``finished_seq_ids`` (finished, aborted or preempted) are dropped
    before anything else; ``block_copies`` (``(src, dst)`` block ids) run before the forward pass."""

    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    running_seqs: list[RunningSequence] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + sum(
            s.num_scheduled_tokens for s in self.running_seqs
        )

    @property
    def is_empty(self) -> bool:
        return not (self.new_seqs or self.running_seqs)


@dataclass(slots=True)
class StepResult:
    """Tokens sampled in one step: one per sequence that reached the end of its known tokens.
    ``logprobs`` is aligned with ``token_ids`` (NaN for sequences that did not ask).
    ``top_token_ids``/``top_logprobs`` hold ``num_top_logprobs`` entries per row, best first
    (a sequence that asked for fewer takes the first ones), when some sequence asked."""

    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    num_top_logprobs: int = 0
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
