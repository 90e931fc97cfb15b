"""A torch-free worker for scheduler tests.

Its "KV cache" stores the token id written at each slot; its "model" reads a sequence's
context back through the block table and picks the next token as a hash of it. Any mistake in
block tables, rollover, copy-on-write or prefix-cache reuse changes what is read back, and so
the output, which tests compare with ``reference_tokens`` (the same rule applied to the plain
token list).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pagewire_common.plan import StepPlan, StepResult

VOCAB = 1000
EOS = 999


def next_token(context: list[int]) -> int:
    digest = hashlib.blake2b(repr(context[-8:]).encode() + len(context).to_bytes(4, "little"), digest_size=8)
    return int.from_bytes(digest.digest(), "little") % (VOCAB - 1)  # never EOS on its own


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(max_tokens):
        ctx.append(next_token(ctx))
    return ctx[len(prompt) :]


@dataclass
class _State:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int


class FakeKVWorker:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.seqs: dict[int, _State] = {}
        self.plans: list[StepPlan] = []
        self.copies: list[tuple[int, int]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        bs = self.block_size
        for sid in plan.finished_seq_ids:
            self.seqs.pop(sid, None)
        for s in plan.new_seqs:
            assert s.seq_id not in self.seqs, "new sequence already known"
            self.seqs[s.seq_id] = _State(list(s.token_ids), list(s.block_ids), s.num_computed_tokens)
        for d in plan.running_seqs:
            st = self.seqs[d.seq_id]
            if d.block_ids:
                del st.block_ids[d.block_table_start :]
                st.block_ids.extend(d.block_ids)
        for src, dst in plan.block_copies:
            self.copies.append((src, dst))
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        result = StepResult(plan.step_id)
        scheduled = [(s.seq_id, s.num_scheduled_tokens) for s in plan.new_seqs]
        scheduled += [(d.seq_id, d.num_scheduled_tokens) for d in plan.running_seqs]
        # write every scheduled token first (as the model does per layer), then "attend"
        for sid, n in scheduled:
            st = self.seqs[sid]
            assert st.num_computed + n <= len(st.token_ids), "scheduled past the known tokens"
            for pos in range(st.num_computed, st.num_computed + n):
                self.slots[st.block_ids[pos // bs] * bs + pos % bs] = st.token_ids[pos]
        for sid, n in scheduled:
            st = self.seqs[sid]
            st.num_computed += n
            if st.num_computed == len(st.token_ids):
                ctx = [self.slots[st.block_ids[p // bs] * bs + p % bs] for p in range(st.num_computed)]
                tok = next_token(ctx)
                st.token_ids.append(tok)
                result.seq_ids.append(sid)
                result.token_ids.append(tok)
        return result


class LaggingLink:
    """Executes a plan only when its result is read: with two plans sent, the second was
    built before the first ran, as with the real worker stream."""

    def __init__(self, worker: FakeKVWorker):
        self.worker = worker
        self.sent = []

    def send(self, plan):
        self.sent.append(plan)

    def receive(self):
        result = self.worker.execute(self.sent.pop(0))
        self.num_sampled = getattr(self, "num_sampled", 0) + len(result.token_ids)
        return result


class DrivenEngine:
    """An ``EngineCore`` as tests drive it: requests by name (sample ``i`` of ``n`` is
    ``"name#i"``), and ``step``/``pipeline_step``/``drain`` that make the engine's one driver's
    calls (``run_step``) and return a token delta per sequence. Everything else is the engine's."""

    def __init__(self, engine, worker):
        from scheduler_svc.core.engine import InProcessLink

        self.engine = engine
        self.link = InProcessLink(worker)  # one plan at a time unless a test passes its own link
        self.ids: dict[str, int] = {}
        self.names: dict[int, str] = {}
        self._next_id = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add_request(self, name: str, prompt_token_ids=None, sampling=None, **kwargs):
        from pagewire_common.sampling import SamplingParams

        n = (sampling or SamplingParams()).n
        if name in self.ids and self.ids[name] in self.engine._requests:
            raise ValueError(f"request id {name!r} is already in flight")
        seq = self.engine.add_request(self._next_id, prompt_token_ids, sampling, **kwargs)
        for index in range(n):
            self.ids[name if index == 0 else f"{name}#{index}"] = self._next_id + index
            self.names[self._next_id + index] = name if index == 0 else f"{name}#{index}"
        self._next_id += n
        return seq

    def request(self, name: str):
        """The sequence of a request (or sample) in flight."""
        return self.engine._requests[self.ids[name]]

    def abort(self, name: str) -> bool:
        return name in self.ids and self.engine.abort(self.ids[name])

    def finish(self, name: str, *args) -> bool:
        return name in self.ids and self.engine.finish(self.ids[name], *args)

    def step(self):
        return self.pipeline_step(self.link, 1)

    def pipeline_step(self, link, max_in_flight: int = 2):
        from scheduler_svc.core.engine import run_step

        step = run_step(self.engine, link, max_in_flight)
        return [] if step is None else self.outputs(step.sequences())

    def drain(self) -> None:
        """Send the plans that only drop ended sequences from the worker."""
        from scheduler_svc.core.engine import run_step

        while not self.engine.is_idle():
            run_step(self.engine, self.link, 1)

    def outputs(self, seqs):
        """A ``TextDelta`` per sequence (one token each), usage on the last."""
        from pagewire_common.requests import TextDelta, Usage

        outs = []
        for seq in seqs:
            out = TextDelta(self.names[seq.seq_id], [seq.token_ids[-1]], "", seq.finish_reason,
                                [seq.logprobs[-1]] if seq.sampling.logprobs else None, index=seq.sample_index)
            if seq.sampling.top_logprobs:
                out.top_logprobs = [seq.top_logprobs[-1]]
            if seq.finish_reason is not None:
                out.usage = Usage(seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_prompt_tokens or 0)
            if seq.num_output_tokens == 1:
                out.num_cached_prompt_tokens = seq.num_cached_prompt_tokens or 0
            outs.append(out)
        return outs
