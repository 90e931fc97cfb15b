"""Per-request state on the scheduler side: what does not change while a sequence runs, and its
tokens. Its progress counters (``num_computed_tokens`` and the rest) live in the scheduler's
``RunningBatch``, in the row ``slot`` names, and nowhere else."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagewire_common.requests import FinishReason, PromptLogprobs
from pagewire_common.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens, what it asked for, and where it stands in the queues."""

    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # the prompt, then every token received (a token sampled by a step still in flight is not here
    # yet: the batch counts it as pending)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (token ids, logprobs) of the most likely tokens at each generated position, when asked
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    # sampling.prompt_logprobs on sample 0: filled as the worker computes the prompt's chunks,
    # delivered with the first token, then dropped (None)
    prompt_logprobs: PromptLogprobs | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    # its row in the scheduler's RunningBatch, from Scheduler.add (or its fork) until it finishes
    slot: int = -1
    # prompt tokens served from the prefix cache at first admission (reported in usage)
    num_cached_prompt_tokens: int | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # whether the worker holds state for this sequence (it was sent as a NewSequence and not dropped)
    is_known_to_worker: bool = False
    # set by Scheduler.add, so the per-token stop check is one set lookup and one
    # comparison: token ids that end the sequence (EOS unless ignore_eos, and stop_token_ids)...
    stop_token_set: frozenset[int] = frozenset()
    # ...and the length it ends at (prompt + max_tokens, capped by the model length)
    max_num_tokens: int = 0
    # a stop token ends the sequence only once it holds more than this many tokens (min_tokens),
    # except these (EOS of a structured sequence: the worker lets it through only at the grammar's end)
    min_num_tokens: int = 0
    end_token_set: frozenset[int] = frozenset()
    # n > 1: which sample this is, and (on sample 0) the other samples, forked from it once its
    # prompt is computed
    sample_index: int = 0
    unforked_samples: list[Sequence] = field(default_factory=list)
    fork_allocation: object | None = None  # the blocks a forked sample starts with (next plan)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
