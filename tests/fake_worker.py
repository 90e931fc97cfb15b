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
