"""Continuous batching: which sequences advance in the next step, and by how many tokens.

There is no prefill or decode mode. Every sequence has a count of computed tokens catching up
with its tokens; a step gives each scheduled sequence a slice of the token budget: one token for
a decode, a chunk for a prompt (chunked prefill), running sequences first so decodes keep flowing
while long prompts are split across steps (and, with prefill pacing, spread over the steps that
follow so that each costs about the same). Admission is first come, first served and limited by
free KV blocks; when running sequences run out of blocks, the newest is preempted (its blocks
freed, recomputed later from its tokens).

A sequence's counters live in the ``RunningBatch`` (``self.batch``), in its row ``seq.slot``; the
``Sequence`` holds its tokens and what does not change while it runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from kvcache.allocator import BlockAllocator
from pagewire_common.plan import NewSequence, StepPlan, StepResult
from pagewire_common.requests import FinishReason, PromptLogprobs
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.running_batch import FAST_DECODE_MIN_ROWS, RunningBatch, StepTokens
from scheduler_svc.core.sequence import Sequence, SequenceStatus

NAN = float("nan")

# the smallest prompt share of a paced step: short prompts go through in one step
PACING_MIN_TOKENS = 16


@dataclass(slots=True)
class StepBudget:
    """What is left of the step being scheduled."""

    tokens: int  # tokens it may still carry
    prompt_tokens: int  # of which prompt tokens (chunks, recomputes, admissions): prefill pacing
    preempted: bool = False  # a running sequence was preempted: nothing is admitted


class Scheduler:
    """Owns the waiting/running queues, the sequences' counters (``batch``) and the block
    allocator; builds step plans.

    Per step: ``schedule()`` builds a plan (and counts its tokens as computed, as if it ran);
    ``apply_result(result)`` appends the sampled tokens and applies the stop conditions that depend
    on tokens only (EOS, stop token ids, max tokens, model length). Stop strings are the caller's
    business: it calls ``finish()`` when it finds one.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, eos_token_ids: tuple[int, ...] = (),
                 fast_decode: bool = True):
        self.config = config
        self.allocator = allocator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.batch = RunningBatch(min(config.max_num_seqs, 1024))
        # plain decodes and plain tokens over the batch's arrays from fast_decode_min_rows rows on
        # (off: every row goes one by one, which gives the same plans; tests compare the two)
        self.fast_decode = fast_decode
        self.fast_decode_min_rows = FAST_DECODE_MIN_ROWS
        self.seqs: dict[int, Sequence] = {}
        self._next_step_id = 0
        # sequences the worker holds state for that must be dropped in the next plan
        self._dropped_seq_ids: list[int] = []
        # samples forked (blocks shared) whose first step is in the next plan
        self._forked: list[Sequence] = []
        # n > 1: sequences whose other samples are not forked yet
        self._parents: list[Sequence] = []
        self.num_preemptions = 0
        # prompt tokens looked up in the prefix cache when first admitted, and those found there
        self.num_prefix_queried_tokens = 0
        self.num_prefix_hit_tokens = 0
        self._caching = allocator.enable_prefix_caching
        self._block_size = allocator.block_size

    # ---- requests -----------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled")
        seq.status = SequenceStatus.WAITING
        self._hold(seq)
        k = seq.sampling.prompt_logprobs
        if k is not None and seq.sample_index == 0:  # the other samples share sample 0's prompt
            seq.prompt_logprobs = PromptLogprobs.empty(seq.num_prompt_tokens, k)
        self.waiting.append(seq)
        if seq.unforked_samples:
            self._parents.append(seq)

    def _hold(self, seq: Sequence) -> int:
        """Take a sequence on: its stop conditions, and its row in the batch (returned)."""
        params = seq.sampling
        stops = frozenset(params.stop_token_ids)
        structured = params.structured_output is not None
        # a grammar ends with EOS (the worker allows nothing else once it is complete), which ends
        # the sequence even under ignore_eos and before min_tokens
        seq.stop_token_set = stops if params.ignore_eos and not structured else stops | self.eos_token_ids
        seq.end_token_set = self.eos_token_ids if structured else frozenset()
        seq.max_num_tokens = min(seq.num_prompt_tokens + params.max_tokens, self.config.max_model_len)
        seq.min_num_tokens = seq.num_prompt_tokens + params.min_tokens
        self.seqs[seq.seq_id] = seq
        return self.batch.add(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence now (stop condition, stop string, abort): free or cache its blocks and
        tell the worker to drop it in the next plan. Idempotent."""
        if seq.is_finished:
            return
        if seq in self._forked:
            self._forked.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq.seq_id in self.seqs:
            self.waiting.remove(seq)
        self._release(seq)
        if seq.slot >= 0:
            self.batch.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if seq.unforked_samples:
            # its blocks are gone: the samples it could not fork yet are admitted on their own
            self._parents.remove(seq)
            for sample in seq.unforked_samples:
                if not sample.is_finished:
                    self.add(sample)
            seq.unforked_samples = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forked)

    def has_pending_drops(self) -> bool:
        return bool(self._dropped_seq_ids)

    def reset(self) -> list[Sequence]:
        """Forget everything (the worker was lost): returns the sequences that were in flight."""
        lost = list(self.running) + list(self.waiting) + self._forked
        self._forked = []
        self._parents = []
        self.running.clear()
        self.waiting.clear()
        self.batch.reset()
        self.seqs.clear()
        self._dropped_seq_ids.clear()
        self.allocator.reset()
        return lost

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """The next step: running sequences first, oldest first (decodes and the rest of chunked
        prompts), then forked samples, then waiting sequences, first come first served."""
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        self.allocator.begin_plan()
        self.batch.recycle()
        tokens = self.config.max_num_batched_tokens
        # prompt tokens (chunks and admissions) this step may carry: the whole budget, unless
        # pacing spreads them out while decodes are running
        budget = StepBudget(tokens, self._prefill_allowance() if self.config.prefill_pacing_steps else tokens)
        self._schedule_running(plan, budget)
        if self._forked:  # after the loop above, which must not schedule them twice
            self._start_forked(plan, budget)
        if not budget.preempted and self.waiting:
            self._admit(plan, budget)
        if self._parents:
            self._fork_samples()
        plan.finished_seq_ids = self._dropped_seq_ids
        self._dropped_seq_ids = []
        return plan

    def _schedule_running(self, plan: StepPlan, budget: StepBudget) -> None:
        """Give the running sequences their slices of the step in running order, each as
        ``_schedule_row`` decides. With ``fast_decode_min_rows`` running or more, the plain decodes
        among them (one token that fits in the sequence's blocks and completes no block) are found
        and advanced over the batch's arrays, which gives what ``_schedule_row`` would, and only
        the other rows go through it, in the same order (an allocation may evict a cached block
        whose hash a later row offers again)."""
        running = self.running
        decodes = None
        if self.fast_decode and len(running) >= self.fast_decode_min_rows:
            decodes = self.batch.plain_decodes(running, self._block_size if self._caching else 0)
            rows = zip(decodes.others, decodes.others_num_plain_before)
        else:
            rows = zip(range(len(running)), repeat(0))
        positions: list[int] = []  # the rows scheduled here, as positions in running...
        counts: list[int] = []  # ...and their tokens
        for pos, num_plain_before in rows:
            tokens = budget.tokens - num_plain_before  # the plain decodes before it come first
            if tokens <= 0 or (budget.preempted and pos >= len(running)):
                break  # the budget is spent, or preemption took this row and every one after it
            # its row in the plan: every plain decode before it runs
            num_new = self._schedule_row(running[pos], tokens, budget, plan, len(positions) + num_plain_before)
            if num_new:
                positions.append(pos)
                counts.append(num_new)
                budget.tokens -= num_new
        if decodes is None:
            plan.running_seq_ids = np.array([running[pos].seq_id for pos in positions], dtype=np.int64)
            plan.running_num_scheduled_tokens = np.array(counts, dtype=np.int64)
        else:
            seq_ids, counts = decodes.commit(len(running), budget.tokens, self.allocator, positions, counts)
            budget.tokens -= len(seq_ids) - len(positions)
            plan.running_seq_ids, plan.running_num_scheduled_tokens = seq_ids, counts

    def _schedule_row(self, seq: Sequence, tokens: int, budget: StepBudget, plan: StepPlan, plan_row: int) -> int:
        """How many tokens a running sequence computes in this step, at most ``tokens`` (> 0); its
        new blocks go into ``plan`` as row ``plan_row``. When blocks run out it preempts the newest
        running sequences, maybe ``seq`` itself (then 0, and ``seq`` is waiting)."""
        batch, slot = self.batch, seq.slot
        computed, pending = batch.computed[slot], batch.pending[slot]
        num_tokens = batch.known[slot] + pending
        num_new = num_tokens - computed
        if num_new <= 0 or (pending and num_tokens >= seq.max_num_tokens):
            return 0  # nothing to compute, or a token in flight already ends the sequence
        if num_new > 1:  # a prompt chunk (or a recompute after preemption), not a decode
            num_new = min(num_new, tokens, budget.prompt_tokens)
            if num_new <= 0:
                return 0
            budget.prompt_tokens -= num_new
        target = computed + num_new
        if target <= batch.limit[slot]:  # its blocks hold it
            if target > batch.slot_tokens[slot]:
                self.allocator.grow_within_limit(seq.seq_id, target)
                batch.slot_tokens[slot] = target
        else:
            while not self._grow(seq, target, plan, plan_row):
                # out of blocks: preempt the newest running sequence (maybe this one)
                budget.preempted = True
                if self._preempt_newest() is seq:
                    return 0
        self._advance(seq, computed + num_new, num_tokens, pending)
        return num_new

    def _grow(self, seq: Sequence, target: int, plan: StepPlan, plan_row: int) -> bool:
        """Blocks for a running sequence to hold ``target`` tokens, past its growth limit: new
        blocks, and a private copy of its last block if that is shared; the change goes into
        ``plan`` as row ``plan_row``. False, with nothing changed, when too few blocks are free."""
        allocator, batch, slot = self.allocator, self.batch, seq.slot
        limit = batch.limit[slot]
        if target == limit + 1 == batch.slot_tokens[slot] + 1 and limit % self._block_size == 0:
            # its blocks are all full: the next token takes a fresh one (append_slots would do
            # the same, at four times the cost)
            block_id = allocator.append_block(seq.seq_id)
            if block_id is None:
                return False
            plan.block_updates.append((plan_row, limit // self._block_size, [block_id]))
            batch.limit[slot] = limit + self._block_size
        else:
            growth = allocator.append_slots(seq.seq_id, target)
            if growth is None:
                return False
            plan.block_updates.append((plan_row, growth.block_table_start, growth.block_ids))
            plan.block_copies.extend(growth.copies)
            batch.limit[slot] = allocator.growth_limit(seq.seq_id)
        batch.slot_tokens[slot] = target
        return True

    def _advance(self, seq: Sequence, computed: int, num_tokens: int, num_pending: int) -> None:
        """Count ``seq``'s first ``computed`` tokens as computed once the plan being built runs (it
        is sent before its result arrives). ``num_tokens``: its tokens, ``num_pending`` of them
        sampled by steps in flight (the caller has them at hand)."""
        batch, slot = self.batch, seq.slot
        batch.computed[slot] = computed
        if computed == num_tokens:
            batch.pending[slot] = num_pending + 1  # the worker samples a token this step
        if self._caching:
            # blocks filled up with tokens the scheduler knows: offer them to the prefix cache
            num_known = num_tokens - num_pending
            num_offered = computed if computed < num_known else num_known
            if num_offered // self._block_size > batch.hashed[slot]:
                self.allocator.cache_blocks(seq.seq_id, seq.token_ids, num_offered, written_by_this_plan=True)
                batch.hashed[slot] = num_offered // self._block_size

    def _admit(self, plan: StepPlan, budget: StepBudget) -> None:
        """Waiting sequences start, first come first served, while the budget, ``max_num_seqs``
        and free blocks allow; the head of the queue is never overtaken."""
        batch, allocator = self.batch, self.allocator
        while self.waiting and min(budget.tokens, budget.prompt_tokens) > 0 \
                and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            slot = seq.slot
            if batch.pending[slot]:
                break  # preempted while a step was in flight: wait for that token first
            # a sequence that wants prompt logprobs computes its whole prompt: no prefix-cache hits
            allocation = allocator.allocate(seq.seq_id, seq.token_ids, use_prefix_cache=seq.prompt_logprobs is None)
            if allocation is None:
                break  # head of line waits for blocks; later arrivals do not overtake it
            self.waiting.popleft()
            computed = allocation.num_cached_tokens
            batch.computed[slot] = computed
            batch.slot_tokens[slot] = len(seq.token_ids)
            self._start_running(seq)
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = min(computed, seq.num_prompt_tokens)
                if self._caching and seq.prompt_logprobs is None:  # a bypass looked nothing up
                    self.num_prefix_queried_tokens += seq.num_prompt_tokens
                    self.num_prefix_hit_tokens += seq.num_cached_prompt_tokens
            num_new = min(len(seq.token_ids) - computed, budget.tokens, budget.prompt_tokens)
            budget.prompt_tokens -= num_new
            plan.block_copies.extend(allocation.copies)
            plan.new_seqs.append(self._new_sequence(seq, allocation.block_ids, computed, num_new))
            self._advance(seq, computed + num_new, len(seq.token_ids), 0)
            budget.tokens -= num_new

    def _new_sequence(self, seq: Sequence, block_ids: list[int], computed: int, num_new: int) -> NewSequence:
        """A sequence as the worker first sees it (``seq`` becomes known to it)."""
        seq.is_known_to_worker = True
        return NewSequence(
            seq_id=seq.seq_id, token_ids=list(seq.token_ids), block_ids=list(block_ids),
            num_computed_tokens=computed, num_scheduled_tokens=num_new, sampling=seq.sampling,
            num_prompt_tokens=seq.num_prompt_tokens,
            stop_token_ids=tuple(sorted(seq.stop_token_set)) if seq.sampling.min_tokens else (),
        )

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.batch.limit[seq.slot] = self.allocator.growth_limit(seq.seq_id)

    def _fork_samples(self) -> None:
        """n > 1: a sequence whose prompt the plan just built computes shares those blocks with its
        other samples (the one holding the last prompt token is copied), which start in the next
        plan, each recomputing that token to sample its own first one. Samples that find no free
        block wait for a later step."""
        batch = self.batch
        for seq in self._parents:
            if seq.status is not SequenceStatus.RUNNING or batch.computed[seq.slot] < seq.num_prompt_tokens:
                continue
            waiting = []
            for sample in seq.unforked_samples:
                if sample.is_finished:
                    continue  # aborted before it started
                allocation = self.allocator.fork(seq.seq_id, sample.seq_id, seq.num_prompt_tokens)
                if allocation is None:
                    waiting.append(sample)
                    continue
                sample.status = SequenceStatus.RUNNING
                sample.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
                sample.fork_allocation = allocation
                slot = self._hold(sample)
                batch.computed[slot] = seq.num_prompt_tokens - 1
                batch.slot_tokens[slot] = seq.num_prompt_tokens
                batch.hashed[slot] = min(batch.hashed[seq.slot], len(allocation.block_ids) - 1)
                self._forked.append(sample)
            seq.unforked_samples = waiting
        self._parents = [seq for seq in self._parents if seq.unforked_samples]

    def _start_forked(self, plan: StepPlan, budget: StepBudget) -> None:
        """Send the forked samples to the worker, oldest first, as many as the step's budget and
        ``max_num_seqs`` leave room for (the others wait for a later step, their blocks held): each
        computes its last prompt token again (in its own copy of that block) and samples.

        Every sample's copy of that block goes in the first plan after its fork, whether or not
        the sample starts: the copy takes no reference on the parent's block, which the parent
        may free (finished, preempted) while the sample waits, and another sequence overwrite."""
        for sample in self._forked:
            allocation = sample.fork_allocation
            if allocation.copies:
                plan.block_copies.extend(allocation.copies)
                sample.fork_allocation = allocation._replace(copies=[])
        room = min(budget.tokens, self.config.max_num_seqs - len(self.running))
        if room <= 0:
            return
        starting, self._forked = self._forked[:room], self._forked[room:]
        for sample in starting:
            allocation = sample.fork_allocation
            sample.fork_allocation = None
            computed = self.batch.computed[sample.slot]  # all of its prompt but the last token
            plan.new_seqs.append(self._new_sequence(sample, allocation.block_ids, computed, 1))
            self._start_running(sample)
            self._advance(sample, computed + 1, sample.num_prompt_tokens, 0)
        budget.tokens -= len(starting)

    def _prefill_allowance(self) -> int:
        """Prefill pacing: how many prompt tokens the next step may carry.

        With no sequence decoding there is no stream to protect and prompts get the whole
        budget. Otherwise the step carries ``1 / prefill_pacing_steps`` of the prompt tokens not
        yet computed (running chunks and waiting prompts), and at least ``PACING_MIN_TOKENS``:
        prefill work that arrives in bursts is spread over the steps that follow, so every step
        costs about the same and decodes see an even inter-token latency, while a backlog that
        grows (load near saturation) raises the share until steps are full again.
        """
        batch = self.batch
        backlog = 0
        decoding = False
        for seq in self.running:
            slot = seq.slot
            remaining = batch.known[slot] + batch.pending[slot] - batch.computed[slot]
            if remaining > 1:
                backlog += remaining
            elif remaining == 1:
                decoding = True
        if not decoding:
            return self.config.max_num_batched_tokens
        for seq in self.waiting:
            slot = seq.slot
            backlog += batch.known[slot] + batch.pending[slot] - batch.computed[slot]
        steps = self.config.prefill_pacing_steps
        return max(PACING_MIN_TOKENS, (backlog + steps - 1) // steps)

    # ---- results ------------------------------------------------------------------------

    def apply_result(self, result: StepResult) -> StepTokens:
        """Apply a step's sampled tokens (``_apply_token``): the sequences that received one, in
        the result's order, finished ones included with ``finish_reason`` set. Tokens for
        sequences that finished or were aborted after the plan was sent are dropped. With
        ``fast_decode_min_rows`` rows or more, the plain tokens (a token that does not end its
        sequence, not its first, no logprobs asked) are appended over the batch's arrays and left
        as arrays in the answer; the rest go one by one."""
        if result.prompt_seq_ids:
            self._apply_prompt_logprobs(result)
        seq_ids = result.seq_ids
        if self.fast_decode and len(seq_ids) >= self.fast_decode_min_rows:
            step, rows = self.batch.take_plain_tokens(result)
        else:
            step, rows = StepTokens(self.batch), range(len(seq_ids))
        seqs = self.seqs
        for i in rows:
            seq = seqs.get(seq_ids[i])
            if seq is not None and self._apply_token(seq, result, i):
                step.other_rows.append(i)
                step.others.append(seq)
        return step

    def _apply_prompt_logprobs(self, result: StepResult) -> None:
        """Store the step's prompt logprob entries in their sequences' ``prompt_logprobs``, by
        entry (a prompt computed again after a preemption rewrites the same entries). Entries of a
        sequence that delivered its own already, or finished, are dropped."""
        seqs = self.seqs
        offset = 0
        for seq_id, start, count in zip(result.prompt_seq_ids, result.prompt_starts, result.prompt_counts):
            seq = seqs.get(seq_id)
            store = seq.prompt_logprobs if seq is not None else None
            if store is not None:
                k = store.num_top
                end = start + count
                store.logprobs[start:end] = result.prompt_logprobs[offset : offset + count]
                if k:
                    store.top_token_ids[start:end] = result.prompt_top_token_ids[offset : offset + count, :k]
                    store.top_logprobs[start:end] = result.prompt_top_logprobs[offset : offset + count, :k]
            offset += count

    def _apply_token(self, seq: Sequence, result: StepResult, i: int) -> bool:
        """Append row ``i``'s token to ``seq`` (False, nothing done: it waits for none) and end
        ``seq`` if the token does."""
        batch, slot = self.batch, seq.slot
        pending = batch.pending[slot]
        if not pending:
            return False
        batch.pending[slot] = pending - 1
        batch.known[slot] += 1
        token_id = result.token_ids[i]
        tokens = seq.token_ids
        tokens.append(token_id)
        sampling = seq.sampling
        if sampling.logprobs:  # NaN where the worker gave none (delivery reads one per token)
            seq.logprobs.append(result.logprobs[i] if result.logprobs is not None else NAN)
        if sampling.top_logprobs:
            start = i * result.num_top_logprobs
            end = start + min(sampling.top_logprobs, result.num_top_logprobs)
            seq.top_logprobs.append((result.top_token_ids[start:end], result.top_logprobs[start:end])
                                    if result.num_top_logprobs else ([], []))
        # the worker masks stop tokens before min_tokens; a stop there is an ordinary token
        if token_id in seq.stop_token_set and (len(tokens) > seq.min_num_tokens or token_id in seq.end_token_set):
            self.finish(seq, FinishReason.STOP)  # EOS (unless ignore_eos), a stop token id, a grammar's end
        elif len(tokens) >= seq.max_num_tokens:
            self.finish(seq, FinishReason.LENGTH)  # max_tokens or the model length
        return True

    # ---- internals ----------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        if self.allocator.has_seq(seq.seq_id):
            self.allocator.free(seq.seq_id)
        if seq.is_known_to_worker:
            self._dropped_seq_ids.append(seq.seq_id)
            seq.is_known_to_worker = False

    def _preempt_newest(self) -> Sequence:
        """Free the newest running sequence's blocks and put it back at the head of the queue; it
        is recomputed from its tokens (prompt and output so far) when readmitted, which gives the
        same greedy output. A token still pending from an in-flight step is kept: it arrives in
        ``apply_result``. Returns that sequence."""
        seq = self.running.pop()
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        batch, slot = self.batch, seq.slot
        batch.computed[slot] = batch.slot_tokens[slot] = batch.hashed[slot] = batch.limit[slot] = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

