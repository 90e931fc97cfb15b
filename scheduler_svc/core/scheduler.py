"""Continuous batching: which sequences advance in the next step, and by how many tokens.

There is no prefill or decode mode. Every sequence has ``num_computed_tokens`` catching up with
``num_tokens``; a step gives each scheduled sequence a slice of the token budget: one token for
a decode, a chunk for a prompt (chunked prefill), running sequences first so decodes keep
flowing while long prompts are split across steps (and, with prefill pacing, spread over the
steps that follow so that each costs about the same). Admission is first come, first served and
limited by free KV blocks; when running sequences run out of blocks, the newest is preempted
(its blocks freed, recomputed later from its tokens).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvcache.allocator import AppendResult, BlockAllocator
from pagewire_common.plan import NewSequence, StepPlan, StepResult
from pagewire_common.requests import FinishReason
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.running_batch import RunningBatch, StepTokens
from scheduler_svc.core.running_step import FAST_DECODE_MIN_ROWS, RunningStep
from scheduler_svc.core.sequence import Sequence, SequenceStatus

_NO_GROWTH = AppendResult(block_table_start=0, block_ids=[], copies=[])
_NO_ROWS = np.zeros(0, dtype=np.int64)
# the smallest prompt share of a paced step: short prompts go through in one step
PACING_MIN_TOKENS = 16


class Scheduler(RunningStep):
    """Owns the waiting/running queues and the block allocator; builds step plans.

    Call order per step: ``schedule()`` builds a plan (and advances ``num_computed_tokens`` as
    if it ran); ``update(result)`` appends the sampled tokens and applies stop conditions that
    depend on tokens only (EOS, stop token ids, max tokens, model length). Stop strings are the
    caller's business: it calls ``finish()`` when it finds one.
    """

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, eos_token_ids: tuple[int, ...] = (),
                 fast_decode: bool = True):
        self.config = config
        self.allocator = allocator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # the running sequences' counters, one slot each, in the order of ``running``
        self.batch = RunningBatch(min(config.max_num_seqs, 1024))
        # plain decodes scheduled and updated over the batch's arrays (off: every sequence takes
        # the per-sequence path, which gives the same plans; tests compare the two)
        self.fast_decode = fast_decode
        self.fast_decode_min_rows = FAST_DECODE_MIN_ROWS
        # every token id that ends some sequence added so far (sorted): a decode's token outside it
        # ends none (it only grows: a stale id sends a few tokens down the per-sequence path)
        self._stop_ids: set[int] = set()
        self._stop_id_array = np.zeros(0, dtype=np.int64)
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
        self._add_stops(seq)
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)
        if seq.unforked_samples:
            self._parents.append(seq)

    def _add_stops(self, seq: Sequence) -> None:
        params = seq.sampling
        stops = frozenset(params.stop_token_ids)
        structured = params.structured_output is not None
        # a grammar ends with EOS (the worker allows nothing else once it is complete), which ends
        # the sequence even under ignore_eos and before min_tokens
        seq.stop_token_set = stops if params.ignore_eos and not structured else stops | self.eos_token_ids
        seq.end_token_set = self.eos_token_ids if structured else frozenset()
        seq.max_num_tokens = min(seq.num_prompt_tokens + params.max_tokens, self.config.max_model_len)
        seq.min_num_tokens = seq.num_prompt_tokens + params.min_tokens
        if not seq.stop_token_set <= self._stop_ids:
            self._stop_ids |= seq.stop_token_set
            self._stop_id_array = np.array(sorted(self._stop_ids), dtype=np.int64)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence now (stop condition, stop string, abort): free or cache its blocks and
        tell the worker to drop it in the next plan. Idempotent."""
        if seq.is_finished:
            return
        if seq in self._forked:
            self._forked.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.batch.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq.seq_id in self.seqs:
            self.waiting.remove(seq)
        self._release(seq)
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
        self.batch.reset()
        self.waiting.clear()
        self.seqs.clear()
        self._dropped_seq_ids.clear()
        self.allocator.reset()
        return lost

    # ---- one step -----------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan(step_id=self._next_step_id)
        self._next_step_id += 1
        budget = self.config.max_num_batched_tokens
        allocator = self.allocator
        # prompt tokens (chunks and admissions) this step may carry: the whole budget, unless
        # pacing spreads them out while decodes are running
        prefill_left = self._prefill_allowance() if self.config.prefill_pacing_steps else budget

        # Running sequences first, oldest first: decodes and the rest of chunked prompts.
        self._prefill_left = prefill_left
        self._preempted = False
        budget = self._schedule_running(plan, budget)
        prefill_left, preempted = self._prefill_left, self._preempted
        running = self.running

        # Forked samples start (one token each; after the loop above, which must not schedule them
        # twice), then waiting sequences are admitted, first come first served, unless we just had
        # to preempt.
        if self._forked:
            budget -= self._start_forked(plan)
        while (
            not preempted
            and self.waiting
            and min(budget, prefill_left) > 0
            and len(running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while a step was in flight: wait for that token first
            allocation = allocator.allocate(seq.seq_id, seq.token_ids)
            if allocation is None:
                break  # head of line waits for blocks; later arrivals do not overtake it
            self.waiting.popleft()
            seq.num_computed_tokens = allocation.num_cached_tokens
            seq.num_slot_tokens = len(seq.token_ids)
            self._start_running(seq)
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = min(allocation.num_cached_tokens, seq.num_prompt_tokens)
                if self._caching:
                    self.num_prefix_queried_tokens += seq.num_prompt_tokens
                    self.num_prefix_hit_tokens += seq.num_cached_prompt_tokens
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, prefill_left)
            prefill_left -= num_new
            plan.block_copies.extend(allocation.copies)
            plan.new_seqs.append(
                NewSequence(
                    seq_id=seq.seq_id,
                    token_ids=list(seq.token_ids),
                    block_ids=list(allocation.block_ids),
                    num_computed_tokens=seq.num_computed_tokens,
                    num_scheduled_tokens=num_new,
                    sampling=seq.sampling,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    stop_token_ids=tuple(sorted(seq.stop_token_set)) if seq.sampling.min_tokens else (),
                )
            )
            seq.is_known_to_worker = True
            self._advance(seq, num_new)
            budget -= num_new

        for seq in self._parents:
            if seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._fork(seq)
        if self._parents:
            self._parents = [seq for seq in self._parents if seq.unforked_samples]
        plan.finished_seq_ids = self._dropped_seq_ids
        self._dropped_seq_ids = []
        return plan

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        self.batch.add(seq, self.allocator.growth_limit(seq.seq_id))

    def _schedule_one(self, seq: Sequence, budget: int) -> tuple[int, AppendResult] | None:
        """A running sequence's slice of ``budget`` (> 0), blocks included: (tokens, growth), or
        None when it gets none. Preempts the newest running sequences when blocks run out, maybe
        ``seq`` itself (then ``seq`` is no longer running)."""
        allocator = self.allocator
        pending = seq.num_pending_tokens
        num_new = len(seq.token_ids) + pending - seq.num_computed_tokens
        if num_new == 1:
            # a decode: its slot exists or fits in its last block
            computed = seq.num_computed_tokens + 1
            if computed <= seq.num_slot_tokens or allocator.grow_in_place(seq.seq_id, computed):
                if computed > seq.num_slot_tokens:
                    seq.num_slot_tokens = computed
                self._advance(seq, 1)
                return 1, _NO_GROWTH
        if num_new > 1:  # a prompt chunk (or a recompute after preemption), not a decode
            num_new = min(num_new, budget, self._prefill_left)
            if num_new <= 0:
                return None
            self._prefill_left -= num_new
        else:
            num_new = min(num_new, budget)
        target = seq.num_computed_tokens + num_new
        if target <= seq.num_slot_tokens:  # a prompt's later chunk: its blocks exist
            grown = _NO_GROWTH
        elif allocator.grow_in_place(seq.seq_id, target):  # a decode inside its last block
            seq.num_slot_tokens = target
            grown = _NO_GROWTH
        else:
            grown = allocator.append_slots(seq.seq_id, target)
            while grown is None:
                # Out of blocks: preempt the newest running sequence (maybe this one).
                victim = self.running[-1]
                self._preempt(victim)
                self._preempted = True
                if victim is seq:
                    return None
                grown = allocator.append_slots(seq.seq_id, target)
            seq.num_slot_tokens = target
            self.batch.limit_view[seq.slot] = allocator.growth_limit(seq.seq_id)
        self._advance(seq, num_new)
        return num_new, grown

    def _fork(self, seq: Sequence) -> None:
        """n > 1: the plan just built computes the rest of ``seq``'s prompt; its other samples share
        those blocks (the one holding the last prompt token is copied) and start in the next plan,
        each recomputing that token to sample its own first one. Samples that find no free block
        wait for a later step."""
        waiting = []
        for sample in seq.unforked_samples:
            if sample.is_finished:
                continue  # aborted before it started
            allocation = self.allocator.fork(seq.seq_id, sample.seq_id, seq.num_prompt_tokens)
            if allocation is None:
                waiting.append(sample)
                continue
            sample.status = SequenceStatus.RUNNING
            sample.num_computed_tokens = seq.num_prompt_tokens - 1
            sample.num_slot_tokens = seq.num_prompt_tokens
            sample.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
            sample.num_hashed_blocks = min(seq.num_hashed_blocks, len(allocation.block_ids) - 1)
            sample.fork_allocation = allocation
            self.seqs[sample.seq_id] = sample
            self._add_stops(sample)
            self._forked.append(sample)
        seq.unforked_samples = waiting

    def _start_forked(self, plan: StepPlan) -> int:
        """Send the forked samples to the worker: each computes its last prompt token again (in its
        own copy of that block) and samples. Returns the tokens this takes from the budget."""
        for sample in self._forked:
            allocation = sample.fork_allocation
            sample.fork_allocation = None
            plan.block_copies.extend(allocation.copies)
            plan.new_seqs.append(NewSequence(
                seq_id=sample.seq_id, token_ids=list(sample.token_ids), block_ids=list(allocation.block_ids),
                num_computed_tokens=sample.num_computed_tokens, num_scheduled_tokens=1, sampling=sample.sampling,
                num_prompt_tokens=sample.num_prompt_tokens,
                stop_token_ids=tuple(sorted(sample.stop_token_set)) if sample.sampling.min_tokens else (),
            ))
            sample.is_known_to_worker = True
            self._start_running(sample)
            self._advance(sample, 1)
        num = len(self._forked)
        self._forked = []
        return num

    def _prefill_allowance(self) -> int:
        """Prefill pacing: how many prompt tokens the next step may carry.

        With no sequence decoding there is no stream to protect and prompts get the whole
        budget. Otherwise the step carries ``1 / prefill_pacing_steps`` of the prompt tokens not
        yet computed (running chunks and waiting prompts), and at least ``PACING_MIN_TOKENS``:
        prefill work that arrives in bursts is spread over the steps that follow, so every step
        costs about the same and decodes see an even inter-token latency, while a backlog that
        grows (load near saturation) raises the share until steps are full again.
        """
        backlog = 0
        decoding = False
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining > 1:
                backlog += remaining
            elif remaining == 1:
                decoding = True
        if not decoding:
            return self.config.max_num_batched_tokens
        for seq in self.waiting:
            backlog += seq.num_tokens - seq.num_computed_tokens
        steps = self.config.prefill_pacing_steps
        return max(PACING_MIN_TOKENS, (backlog + steps - 1) // steps)

    def _advance(self, seq: Sequence, num_new: int) -> None:
        """Count a scheduled slice as computed (the plan is sent before its result arrives)."""
        computed = seq.num_computed_tokens + num_new
        seq.num_computed_tokens = computed
        num_known = len(seq.token_ids)
        if computed == num_known + seq.num_pending_tokens:
            seq.num_pending_tokens += 1  # the worker samples a token this step
        if self._caching and computed // self._block_size > seq.num_hashed_blocks:
            # a block filled up: offer it to the prefix cache
            self._offer_blocks(seq, min(computed, num_known))

    def _offer_blocks(self, seq: Sequence, known: int) -> None:
        """Offer the blocks that the first ``known`` tokens fill to the prefix cache."""
        if known // self._block_size > seq.num_hashed_blocks:
            self.allocator.cache_blocks(seq.seq_id, seq.token_ids, known)
            seq.num_hashed_blocks = known // self._block_size

    def update(self, result: StepResult) -> list[Sequence]:
        """Apply a step's sampled tokens. Returns the sequences that received a token, in the
        result's order (finished ones included, with ``finish_reason`` set). Tokens for sequences
        that finished or were aborted after the plan was sent are dropped."""
        return self.apply_result(result).sequences()

    def apply_result(self, result: StepResult) -> StepTokens:
        """``update``, with the plain decodes' tokens left as arrays: a token for a running
        sequence that does not end it (no stop token, not its last) and asks for no logprobs is
        appended over the batch's arrays; the rest take the per-sequence path."""
        batch = self.batch
        seq_id_list, token_id_list = result.seq_ids, result.token_ids
        if self.fast_decode and len(seq_id_list) >= self.fast_decode_min_rows:
            seq_ids = np.asarray(seq_id_list, dtype=np.int64)
            token_ids = np.asarray(token_id_list, dtype=np.int64)
            slots = batch.slots_of(seq_ids)
            at = np.maximum(slots, 0)
            known = batch.known[at]
            # a first output token goes one by one: its delivery says how much of the prompt was cached
            plain = (slots >= 0) & (batch.pending[at] > 0) & (known + 1 < batch.max_tokens[at])
            plain &= known > batch.num_prompt[at]
            plain &= ~batch.slow_update[at]
            stop_ids = self._stop_id_array  # sorted; searchsorted is cheaper than np.isin
            if len(stop_ids):
                plain &= stop_ids[np.minimum(np.searchsorted(stop_ids, token_ids), len(stop_ids) - 1)] != token_ids
            plain_rows = plain.nonzero()[0]
            plain_slots = slots[plain_rows]
            plain_tokens = token_ids[plain_rows]
            batch.pending[plain_slots] -= 1
            batch.known[plain_slots] += 1
            for _ in map(list.append, map(batch.token_lists.__getitem__, plain_slots.tolist()), plain_tokens.tolist()):
                pass
            other_rows = [] if len(plain_rows) == len(slots) else (~plain).nonzero()[0].tolist()
            if other_rows:
                seq_id_list, token_id_list = seq_ids.tolist(), token_ids.tolist()
        else:
            plain_rows = plain_slots = plain_tokens = _NO_ROWS
            other_rows = range(len(seq_id_list))
        touched_rows: list[int] = []
        touched: list[Sequence] = []
        seqs = self.seqs
        logprobs = result.logprobs
        num_top = result.num_top_logprobs
        pending, known = batch.pending_view, batch.known_view
        for i in other_rows:
            seq = seqs.get(seq_id_list[i])
            if seq is None:
                continue
            slot = seq.slot
            if seq.batch is None:  # not running (preempted with a token in flight)
                if seq.num_pending_tokens == 0:
                    continue
                seq.num_pending_tokens -= 1
            else:
                if pending[slot] == 0:
                    continue
                pending[slot] -= 1
                known[slot] += 1
            token_id = token_id_list[i]
            tokens = seq.token_ids
            tokens.append(token_id)
            if logprobs is not None and seq.sampling.logprobs:
                seq.logprobs.append(logprobs[i])
            if num_top and seq.sampling.top_logprobs:
                start = i * num_top
                end = start + seq.sampling.top_logprobs
                seq.top_logprobs.append((result.top_token_ids[start:end], result.top_logprobs[start:end]))
            touched_rows.append(i)
            touched.append(seq)
            # the worker masks stop tokens before min_tokens; a stop there is an ordinary token
            if token_id in seq.stop_token_set and (len(tokens) > seq.min_num_tokens or token_id in seq.end_token_set):
                self.finish(seq, FinishReason.STOP)  # EOS (unless ignore_eos), a stop token id, a grammar's end
            elif len(tokens) >= seq.max_num_tokens:
                self.finish(seq, FinishReason.LENGTH)  # max_tokens or the model length
        return StepTokens(batch, plain_rows, plain_slots, batch.seq_id[plain_slots], plain_tokens, touched_rows, touched)

    # ---- internals ----------------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        if self.allocator.has_seq(seq.seq_id):
            self.allocator.free(seq.seq_id)
        if seq.is_known_to_worker:
            self._dropped_seq_ids.append(seq.seq_id)
            seq.is_known_to_worker = False

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and put it back at the head of the queue; it is recomputed
        from its tokens (prompt and output so far) when readmitted, which gives the same greedy
        output. A token still pending from an in-flight step is kept: it arrives in ``update``."""
        self.running.remove(seq)
        self.batch.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_slot_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
