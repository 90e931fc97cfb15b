"""Per-sequence logit adjustments on the device, batched over the rows of one step.

Applied to the logits of the rows a step samples, in this order: ``logit_bias``, ``min_tokens``
(the sequence's stop tokens masked while it has fewer generated tokens), repetition, presence
and frequency penalties, then the grammar's token mask (``worker_svc.structured``). Each stage
runs only when some row of the step uses it, and then as a few tensor operations over all such
rows at once; a step in which no sequence asks for any adjustment pays one integer comparison.

Penalties need each sequence's token counts. They live here, in two tables with one slot per
sequence that uses penalties: ``counts`` (occurrences of each generated token) and
``prompt_seen`` (the prompt's tokens, which repetition_penalty also covers). A slot is filled
from the sequence's tokens when the worker learns of it (new, or readmitted after a preemption
with the tokens generated so far), and the token sampled at each step is added on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.plan_state import SeqState
from worker_svc.structured import GrammarMasks


@dataclass(slots=True)
class _PenaltyRows:
    rows: torch.Tensor  # [P] indices into the step's sampled rows
    slots: torch.Tensor  # [P] their slots in the count tables


class LogitsAdjuster:
    def __init__(self, vocab_size: int, device: torch.device, grammars: GrammarMasks | None = None):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.grammars = grammars
        self.counts: torch.Tensor | None = None  # [slots, vocab] int32: occurrences in generated tokens
        self.prompt_seen: torch.Tensor | None = None  # [slots, vocab] bool: the token is in the prompt
        self._free_slots: list[int] = []
        self.num_adjusted = 0  # sequences held that use some adjustment
        self._step_penalties: _PenaltyRows | None = None

    # ---- sequences ------------------------------------------------------------------------

    def add(self, state: SeqState) -> None:
        """A sequence the worker just learned of (new, or readmitted after a preemption)."""
        sp = state.sampling
        if sp.has_penalties:
            slot = self._alloc_slot()
            state.penalty_slot = slot
            tokens = torch.tensor(state.token_ids, dtype=torch.int64).to(self.device)
            num_prompt = state.num_prompt_tokens
            self.prompt_seen[slot].zero_()
            self.prompt_seen[slot, tokens[:num_prompt]] = True
            self.counts[slot] = torch.bincount(tokens[num_prompt:], minlength=self.vocab_size)[: self.vocab_size]
        if sp.structured_output is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer.json, which this worker lacks")
            self.grammars.add(state)
        state.is_adjusted = bool(sp.logit_bias or sp.min_tokens or sp.has_penalties or sp.structured_output)
        self.num_adjusted += state.is_adjusted

    def drop(self, state: SeqState) -> None:
        if state.penalty_slot is not None:
            self._free_slots.append(state.penalty_slot)
            state.penalty_slot = None
        if state.matcher is not None:
            self.grammars.drop(state)
        self.num_adjusted -= state.is_adjusted
        state.is_adjusted = False

    def reset(self) -> None:
        self.counts = self.prompt_seen = None
        self._free_slots = []
        self.num_adjusted = 0
        if self.grammars is not None:
            self.grammars.reset()

    def _alloc_slot(self) -> int:
        if not self._free_slots:
            old = 0 if self.counts is None else self.counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
            seen = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
            if old:
                counts[:old] = self.counts
                seen[:old] = self.prompt_seen
            self.counts, self.prompt_seen = counts, seen
            self._free_slots = list(range(new - 1, old - 1, -1))
        return self._free_slots.pop()

    # ---- one step -------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor, states: list[SeqState]) -> None:
        """Adjust ``logits`` [N, V] (fp32, row i samples ``states[i]``) in place."""
        self._step_penalties = None
        if not self.num_adjusted:
            return
        adjusted = [i for i, s in enumerate(states) if s.is_adjusted]
        if not adjusted:
            return
        if self.grammars is not None:
            self.grammars.wait()  # the matchers are being read by the mask filler until then
        dev = self.device
        bias_rows: list[int] = []
        bias_tokens: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_tokens: list[int] = []
        pen_rows: list[int] = []
        pen_slots: list[int] = []
        pen_params: list[tuple[float, float, float]] = []
        grammar_rows: list[int] = []
        for i in adjusted:
            state = states[i]
            sp = state.sampling
            if sp.logit_bias:
                bias_rows.extend([i] * len(sp.logit_bias))
                bias_tokens.extend(t for t, _ in sp.logit_bias)
                bias_values.extend(b for _, b in sp.logit_bias)
            # a complete grammar allows only EOS, and ends the sequence before min_tokens
            if (sp.min_tokens and len(state.token_ids) - state.num_prompt_tokens < sp.min_tokens
                    and not (state.matcher is not None and state.matcher.is_stopped())):
                ban_rows.extend([i] * len(state.stop_token_ids))
                ban_tokens.extend(state.stop_token_ids)
            if state.penalty_slot is not None:
                pen_rows.append(i)
                pen_slots.append(state.penalty_slot)
                pen_params.append((sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty))
            if state.matcher is not None:
                grammar_rows.append(i)
        if bias_rows:
            index = torch.tensor([bias_rows, bias_tokens], dtype=torch.int64).to(dev, non_blocking=True)
            values = torch.tensor(bias_values, dtype=logits.dtype).to(dev, non_blocking=True)
            logits.index_put_((index[0], index[1]), values, accumulate=True)
        if ban_rows:
            index = torch.tensor([ban_rows, ban_tokens], dtype=torch.int64).to(dev, non_blocking=True)
            logits[index[0], index[1]] = float("-inf")
        if pen_rows:
            self._apply_penalties(logits, pen_rows, pen_slots, pen_params)
        if grammar_rows:
            self.grammars.apply(logits, states, grammar_rows)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[int], slots: list[int],
                         params: list[tuple[float, float, float]]) -> None:
        dev = self.device
        rows_t = torch.tensor(rows, dtype=torch.int64).to(dev, non_blocking=True)
        slots_t = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        p = torch.tensor(params, dtype=logits.dtype).to(dev, non_blocking=True)  # [P, 3]
        repetition, presence, frequency = p[:, 0:1], p[:, 1:2], p[:, 2:3]
        counts = self.counts[slots_t]  # [P, V]
        appeared = counts > 0
        x = logits[rows_t]  # [P, V]
        # transformers' RepetitionPenaltyLogitsProcessor, over prompt and generated tokens
        seen = appeared | self.prompt_seen[slots_t]
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
        # OpenAI's presence and frequency penalties, over generated tokens
        x = x - frequency * counts.to(x.dtype) - presence * appeared.to(x.dtype)
        logits[rows_t] = x
        self._step_penalties = _PenaltyRows(rows_t, slots_t)

    def record(self, tokens: torch.Tensor) -> None:
        """Count the tokens just sampled (``tokens`` [N] on the device) for the penalty rows."""
        step = self._step_penalties
        if step is None:
            return
        self._step_penalties = None
        ones = torch.ones(step.rows.shape[0], dtype=torch.int32, device=self.device)
        self.counts.index_put_((step.slots, tokens[step.rows]), ones, accumulate=True)
