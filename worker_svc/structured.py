"""Structured output on the worker: one llguidance matcher per constrained sequence, and the token
masks of a step applied to the logits on the device.

The tokenizer is built once per worker from the model's ``tokenizer.json``; a grammar is compiled
once per text (``pagewire_common.grammar``) into a template matcher, and each sequence starts from
a copy of it. A sequence the worker learns of with generated tokens (readmitted after a
preemption) has its matcher rebuilt by feeding them. The matcher advances with every token the
worker samples, so it is always one step ahead of the scheduler, as overlap needs.

Per step, the masks of the rows that have a matcher are filled on the host into one
``[rows, ceil(vocab / 32)]`` int32 bitmask by llguidance's thread pool, while the forward pass runs
(``start`` is called before it, ``apply`` waits); ``apply`` copies it to the device once and sets
the logits of every disallowed token to -inf. Rows without a grammar are not touched, and a step
with none pays one integer test.

The end of the grammar ends the sequence: a complete grammar allows only EOS, which the scheduler
takes as STOP even under ``ignore_eos`` and before ``min_tokens`` (those never keep a sequence
going past its grammar). Under ``ignore_eos`` EOS is taken out of the mask while the grammar can
still go on, so the output runs until the grammar is complete or ``max_tokens``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import numpy as np
import torch

from pagewire_common.grammar import grammar_of
from pagewire_common.wire import tokenizer_eos_token_id
from worker_svc.plan_state import SeqState

log = logging.getLogger("pagewire.worker")

_MAX_TEMPLATES = 256  # compiled grammars kept (LRU), one template matcher each
_BITS = 32


class GrammarMasks:
    """The structured-output sequences of one worker: their matchers and their token masks."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        # the mask covers the model's whole vocabulary (ids past the tokenizer's are never allowed)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(self.eos_token_ids))
        self.num_words = -(-vocab_size // _BITS)
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor = llguidance.LLExecutor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagewire-grammar")
        self._host = self._host_buffer(8)  # [rows, words] int32
        self._pending: Future | None = None  # the fill under way, if any
        self._filled_for: list[SeqState] | None = None  # the step's states the buffer is filled for
        # bit j of byte k of a mask row allows token 8k + j: llguidance sets bit t % 32 of word t // 32,
        # and the words are little-endian (as on every host torch supports)
        self._byte_bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=self.device)
        self.num_active = 0  # sequences held that have a matcher

    @classmethod
    def for_model(cls, model_dir: Path, vocab_size: int, eos_token_ids: tuple[int, ...], device) -> "GrammarMasks | None":
        """Masks for the model in ``model_dir``, or None when it has no ``tokenizer.json`` or the
        grammar engine refuses its tokenizer (one with more tokens than the model's vocabulary):
        the worker then serves without structured output and says so."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            return None
        text = path.read_text()
        eos = tuple(eos_token_ids)
        # the scheduler ends sequences on the tokenizer's EOS too (WorkerInfo.build), so the
        # grammar's end must allow it
        config = Path(model_dir) / "tokenizer_config.json"
        files = {"tokenizer.json": text.encode(), **({config.name: config.read_bytes()} if config.is_file() else {})}
        extra = tokenizer_eos_token_id(files)
        if extra is not None and extra not in eos:
            eos += (extra,)
        try:
            return cls(text, vocab_size, eos, device)
        except ValueError as e:
            log.warning("structured output is off for this model: the grammar engine refuses its tokenizer (%s)", e)
            return None

    # ---- sequences ------------------------------------------------------------------------

    def add(self, state: SeqState) -> None:
        """Give ``state`` a matcher at the point its generated tokens reached."""
        matcher = self._template(*state.sampling.structured_output).deep_copy()
        generated = state.token_ids[state.num_prompt_tokens:]
        if generated and not matcher.consume_tokens(generated):
            log.warning("grammar matcher rejected a sequence's own tokens: %s", matcher.get_error())
        state.matcher = matcher
        self.num_active += 1

    def drop(self, state: SeqState) -> None:
        if state.matcher is not None:
            state.matcher = None
            self.num_active -= 1

    def reset(self) -> None:
        self.wait()
        self._filled_for = None
        self.num_active = 0

    def _template(self, kind: str, text: str) -> llguidance.LLMatcher:
        key = (kind, text)
        matcher = self._templates.get(key)
        if matcher is not None:
            self._templates.move_to_end(key)
            return matcher
        matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(kind, text), log_level=0)
        if matcher.is_error():  # checked without a tokenizer by the API server; this one refuses it
            log.warning("%s does not compile for this tokenizer: %s", kind, matcher.get_error())
        self._templates[key] = matcher
        if len(self._templates) > _MAX_TEMPLATES:
            self._templates.popitem(last=False)
        return matcher

    # ---- one step -------------------------------------------------------------------------

    def start(self, states: list[SeqState]) -> None:
        """Begin filling the masks of the rows of ``states`` (the step's sampled sequences) that
        have a matcher, on a helper thread (llguidance drops the GIL), while the model runs."""
        self.wait()
        jobs = [(s.matcher, i) for i, s in enumerate(states) if s.matcher is not None]
        if not jobs:
            return
        if self._host.shape[0] < len(states):
            self._host = self._host_buffer(max(len(states), 2 * self._host.shape[0]))
        host = self._host
        self._filled_for = states
        self._pending = self._pool.submit(
            self._executor.unsafe_compute_mask_ptr, jobs, host.data_ptr(), self.num_words * 4, host.shape[0]
        )

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def apply(self, logits: torch.Tensor, states: list[SeqState], rows: list[int]) -> None:
        """Mask ``logits`` [N, V] in place at ``rows``: row i samples ``states[i]``, and ``rows``
        are those with a matcher. Uses the masks ``start(states)`` filled, or fills them now."""
        if self._filled_for is not states:
            self.start(states)
        self.wait()
        self._filled_for = None
        host = self._host.numpy()
        masks = host[rows]  # [G, words], in row order
        if any(s.sampling.ignore_eos for s in states):
            self._hold_eos(masks, [states[i] for i in rows])
        mask = torch.from_numpy(masks)
        if self.device.type != "cpu":
            mask = mask.pin_memory().to(self.device, non_blocking=True)
        # [G, words * 32] bool: unpacked byte-wise (uint8), a quarter of the memory of int32 shifts
        banned = (mask.view(torch.uint8).unsqueeze(-1) & self._byte_bits).view(len(rows), -1)[:, : logits.shape[1]] == 0
        rows_t = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
        logits[rows_t] = logits[rows_t].masked_fill(banned, float("-inf"))

    def _hold_eos(self, masks: np.ndarray, states: list[SeqState]) -> None:
        """``ignore_eos``: no EOS while the grammar may go on with some other token."""
        words = masks.view(np.uint32)
        for j, state in enumerate(states):
            if not state.sampling.ignore_eos or state.matcher.is_stopped():
                continue
            row = words[j].copy()
            for eos in self.eos_token_ids:
                row[eos // _BITS] &= ~np.uint32(1 << (eos % _BITS))
            if row.any():
                words[j] = row

    def advance(self, states: list[SeqState], tokens: list[int]) -> None:
        """Feed each constrained sequence the token it just sampled."""
        for state, token in zip(states, tokens):
            matcher = state.matcher
            if matcher is not None and not matcher.is_stopped():
                matcher.consume_token(token)

    def choose(self, state: SeqState, preferred: int) -> int:
        """The null runner's pick for a constrained sequence: ``preferred`` when the grammar allows
        it, else EOS when allowed (unless ``ignore_eos`` holds it), else the lowest allowed id."""
        words = np.frombuffer(state.matcher.compute_bitmask(), dtype=np.uint32)[None, :].copy()
        if state.sampling.ignore_eos:
            self._hold_eos(words.view(np.int32), [state])
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size])
        if preferred in allowed:
            return preferred
        eos = [t for t in self.eos_token_ids if t in allowed]
        return eos[0] if eos else int(allowed[0])

    def _host_buffer(self, rows: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.full((rows, self.num_words), -1, dtype=torch.int32, pin_memory=pin)
