"""Per-request state on the scheduler side."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagewire_common.requests import FinishReason
from pagewire_common.sampling import SamplingParams

if TYPE_CHECKING:
    from scheduler_svc.core.running_batch import RunningBatch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def _counter(own: str, array: str, doc: str) -> property:
    """A counter of a Sequence: its attribute ``own`` while it is not running, the RunningBatch's
    array ``array`` at its slot while it is (through the batch's memoryview of it)."""
    view = f"{array}_view"

    def get(seq: "Sequence") -> int:
        batch = seq.batch
        return getattr(seq, own) if batch is None else getattr(batch, view)[seq.slot]

    def set_(seq: "Sequence", value: int) -> None:
        batch = seq.batch
        if batch is None:
            setattr(seq, own, value)
        else:
            getattr(batch, view)[seq.slot] = value

    return property(get, set_, doc=doc)


@dataclass(slots=True, eq=False)
class Sequence:
    """One request's tokens and progress.

    ``num_computed_tokens`` counts tokens whose K/V the worker has written, or will have written
    once the plans already sent run: it advances when a step is *scheduled*, not when its result
    arrives, so the next plan can be built before the previous result is back. A token sampled by
    a step whose result has not arrived yet is counted in ``num_pending_tokens``: the worker knows
    it, the scheduler does not yet.
    """

    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # (token ids, logprobs) of the most likely tokens at each generated position, when asked
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # prompt tokens served from the prefix cache at first admission (reported in usage)
    num_cached_prompt_tokens: int | None = None
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    # whether the worker holds state for this sequence (it was sent as a NewSequence and not dropped)
    is_known_to_worker: bool = False
    # while running: the scheduler's RunningBatch and this sequence's row there, which then holds the
    # counters behind num_computed_tokens, num_pending_tokens, num_slot_tokens and num_hashed_blocks
    batch: RunningBatch | None = field(default=None, repr=False)
    slot: int = -1
    # the counters while not running (see the properties; stale while running, so not in the repr)
    _num_computed_tokens: int = field(default=0, repr=False)
    _num_pending_tokens: int = field(default=0, repr=False)
    _num_slot_tokens: int = field(default=0, repr=False)
    _num_hashed_blocks: int = field(default=0, repr=False)
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
    unforked_samples: list["Sequence"] = field(default_factory=list)
    fork_allocation: object | None = None  # the blocks a forked sample starts with (next plan)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    num_computed_tokens = _counter("_num_computed_tokens", "computed", "Tokens whose K/V the worker has written or "
                                   "will have written once the plans sent run.")
    num_pending_tokens = _counter("_num_pending_tokens", "pending", "Tokens sampled by steps whose results have not "
                                  "arrived yet.")
    num_slot_tokens = _counter("_num_slot_tokens", "slot_tokens", "How many tokens the allocator has slots for (its "
                               "view of the sequence's length).")
    num_hashed_blocks = _counter("_num_hashed_blocks", "hashed", "Full blocks already offered to the prefix cache "
                                 "(cache_blocks is called only when one fills).")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """All tokens, including ones sampled by in-flight steps."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
