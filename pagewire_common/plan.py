"""The step plan (scheduler -> worker) and the step result (worker -> scheduler).

A plan is a *diff* against what the worker already holds: a new sequence is sent once in full,
a running one only as the change to its block table and how many tokens to compute. These are
plain dataclasses; the gRPC layer converts them to and from protobuf at the edge.

Torch-free (numpy for the running rows): the scheduler imports this and must never pull in torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

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


class StepPlan:
    """One step for the worker. ``finished_seq_ids`` (finished, aborted or preempted) are dropped
    before anything else; ``block_copies`` (``(src, dst)`` block ids) run before the forward pass.

    The running sequences' part is held as arrays, as it travels on the wire: row ``i`` computes
    ``running_num_scheduled_tokens[i]`` tokens of sequence ``running_seq_ids[i]``, and
    ``block_updates`` holds ``(row, block_table_start, block_ids)`` for the rows whose block table
    changes, rows ascending. ``running_seqs`` gives the same rows as ``RunningSequence`` objects
    (built on first use); a plan built from such a list (``running_seqs=``) converts it once.
    """

    __slots__ = ("step_id", "new_seqs", "running_seq_ids", "running_num_scheduled_tokens", "block_updates",
                 "finished_seq_ids", "block_copies", "_running_seqs")

    def __init__(self, step_id: int, new_seqs: list[NewSequence] | None = None,
                 running_seqs: list[RunningSequence] | None = None, finished_seq_ids: list[int] | None = None,
                 block_copies: list[tuple[int, int]] | None = None, *, running_seq_ids=None,
                 running_num_scheduled_tokens=None, block_updates: list[tuple[int, int, list[int]]] | None = None):
        self.step_id = step_id
        self.new_seqs = new_seqs if new_seqs is not None else []
        self.finished_seq_ids = finished_seq_ids if finished_seq_ids is not None else []
        self.block_copies = block_copies if block_copies is not None else []
        if running_seqs:
            if running_seq_ids is not None:
                raise ValueError("give the running rows either as running_seqs or as arrays, not both")
            running_seq_ids = [r.seq_id for r in running_seqs]
            running_num_scheduled_tokens = [r.num_scheduled_tokens for r in running_seqs]
            block_updates = [(i, r.block_table_start, list(r.block_ids)) for i, r in enumerate(running_seqs)
                             if r.block_ids]
        self.running_seq_ids = np.asarray(running_seq_ids if running_seq_ids is not None else (), dtype=np.int64)
        self.running_num_scheduled_tokens = np.asarray(
            running_num_scheduled_tokens if running_num_scheduled_tokens is not None else (), dtype=np.int64)
        if len(self.running_seq_ids) != len(self.running_num_scheduled_tokens):
            raise ValueError("running_seq_ids and running_num_scheduled_tokens differ in length")
        self.block_updates = block_updates if block_updates is not None else []
        self._running_seqs: list[RunningSequence] | None = None

    @property
    def running_seqs(self) -> list[RunningSequence]:
        """The running rows as objects (one list per plan, built on first use: do not modify)."""
        if self._running_seqs is None:
            rows = [RunningSequence(seq_id, n) for seq_id, n in
                    zip(self.running_seq_ids.tolist(), self.running_num_scheduled_tokens.tolist())]
            for row, start, block_ids in self.block_updates:
                rows[row].block_table_start = start
                rows[row].block_ids = block_ids
            self._running_seqs = rows
        return self._running_seqs

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new_seqs) + int(self.running_num_scheduled_tokens.sum())

    @property
    def is_empty(self) -> bool:
        return not (self.new_seqs or len(self.running_seq_ids))

    def __eq__(self, other) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        return (self.step_id == other.step_id and self.new_seqs == other.new_seqs
                and np.array_equal(self.running_seq_ids, other.running_seq_ids)
                and np.array_equal(self.running_num_scheduled_tokens, other.running_num_scheduled_tokens)
                and [(r, s, list(b)) for r, s, b in self.block_updates]
                == [(r, s, list(b)) for r, s, b in other.block_updates]
                and list(self.finished_seq_ids) == list(other.finished_seq_ids)
                and [tuple(c) for c in self.block_copies] == [tuple(c) for c in other.block_copies])

    __hash__ = None

    def __repr__(self) -> str:
        return (f"StepPlan(step_id={self.step_id}, new_seqs={self.new_seqs!r}, running_seqs={self.running_seqs!r}, "
                f"finished_seq_ids={self.finished_seq_ids!r}, block_copies={self.block_copies!r})")


@dataclass(slots=True)
class StepResult:
    """Tokens sampled in one step: one per sequence that reached the end of its known tokens.
    ``logprobs`` is aligned with ``token_ids`` (NaN for sequences that did not ask).
    ``top_token_ids``/``top_logprobs`` hold ``num_top_logprobs`` entries per row, best first
    (a sequence that asked for fewer takes the first ones), when some sequence asked.

    Prompt logprobs (``SamplingParams.prompt_logprobs``), only when a sequence of the step asked:
    row ``r`` gives ``prompt_counts[r]`` entries of sequence ``prompt_seq_ids[r]`` from entry
    ``prompt_starts[r]`` (entry ``i``: prompt token ``i + 1`` given tokens ``0..i``), its entries
    consecutive in ``prompt_logprobs`` [E] and ``prompt_top_token_ids``/``prompt_top_logprobs``
    [E, num_prompt_top_logprobs] (best first; a sequence that asked for fewer takes the first ones).
    A sequence appears here in each step that computes some of its prompt, sampled or not."""

    step_id: int
    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    num_top_logprobs: int = 0
    top_token_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    prompt_seq_ids: list[int] = field(default_factory=list)
    prompt_starts: list[int] = field(default_factory=list)
    prompt_counts: list[int] = field(default_factory=list)
    prompt_logprobs: np.ndarray | None = None  # [E] float32
    num_prompt_top_logprobs: int = 0
    prompt_top_token_ids: np.ndarray | None = None  # [E, num_prompt_top_logprobs] int32
    prompt_top_logprobs: np.ndarray | None = None  # [E, num_prompt_top_logprobs] float32
