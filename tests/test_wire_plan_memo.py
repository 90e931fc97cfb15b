"""``plan_to_pb`` keeps the last sampling message by the params' identity: each new sequence must
still carry its own parameters, whatever came before it."""

from __future__ import annotations

import dataclasses

from pagewire_common import wire
from pagewire_common.plan import NewSequence, StepPlan
from pagewire_common.sampling import SamplingParams


def _new(seq_id: int, sampling: SamplingParams) -> NewSequence:
    return NewSequence(seq_id=seq_id, token_ids=[1, 2, 3], block_ids=[0], num_computed_tokens=0,
                       num_scheduled_tokens=3, sampling=sampling, num_prompt_tokens=3)


def test_each_new_sequence_carries_its_own_sampling() -> None:
    greedy = SamplingParams(temperature=0, max_tokens=5)
    hot = SamplingParams(temperature=0.5, max_tokens=9, seed=3)
    equal_to_greedy = dataclasses.replace(greedy)  # another object, equal by value
    long_stop = SamplingParams(max_tokens=4, stop=("x" * 2000,))  # too big to memoize
    order = [greedy, greedy, hot, greedy, equal_to_greedy, long_stop, hot, long_stop, greedy]
    plan = StepPlan(0, new_seqs=[_new(i, params) for i, params in enumerate(order)])
    decoded = wire.plan_from_pb(wire.plan_to_pb(plan))
    assert [s.sampling for s in decoded.new_seqs] == order
    assert decoded.new_seqs == plan.new_seqs
    # and again, one plan at a time (the memo outlives a plan)
    for i, params in enumerate(order):
        one = wire.plan_from_pb(wire.plan_to_pb(StepPlan(i, new_seqs=[_new(i, params)])))
        assert one.new_seqs[0].sampling == params
