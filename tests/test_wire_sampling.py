"""Sampling parameters across the wire: exact round trips, and the memo of both conversions."""

from __future__ import annotations

import pytest

from pagewire_common import wire
from pagewire_common.plan import NewSequence, StepPlan
from pagewire_common.sampling import SamplingParams
from pagewire_common.v1 import generation_pb2 as gen_pb

BIG_SCHEMA = '{"type": "object", "properties": {' + ", ".join(
    f'"field_{i}": {{"type": "integer"}}' for i in range(80)) + "}}"

# float fields travel as fp32, so the values here are exact in fp32
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.75, top_p=0.875, top_k=40, seed=1234, max_tokens=64, min_p=0.0625),
    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3),
    SamplingParams(stop=("\n\n", "END"), stop_token_ids=(2, 7), min_tokens=3, n=2),
    SamplingParams(repetition_penalty=1.25, presence_penalty=0.5, frequency_penalty=-0.5,
                   logit_bias={5: -100.0, 17: 2.5}),
    SamplingParams(regex=r"[a-z]+"),
    SamplingParams(json_schema=BIG_SCHEMA, max_tokens=200),  # past the memo's size bound
]


@pytest.mark.parametrize("params", PARAMS, ids=range(len(PARAMS)))
def test_round_trip_is_exact_and_repeatable(params):
    for _ in range(3):
        assert wire.sampling_from_pb(wire.sampling_to_pb(params)) == params


def test_small_parameter_sets_are_decoded_once():
    msg = gen_pb.SamplingParams(temperature=0.3, max_tokens=12, seed=99)
    first = wire.sampling_from_pb(msg)
    again = wire.sampling_from_pb(gen_pb.SamplingParams.FromString(msg.SerializeToString()))
    assert again is first
    # a different value is a different entry
    assert wire.sampling_from_pb(gen_pb.SamplingParams(temperature=0.3, max_tokens=13, seed=99)).max_tokens == 13


def test_large_parameter_sets_are_not_remembered():
    msg = wire.sampling_to_pb(PARAMS[-1])
    assert msg.ByteSize() > wire._SAMPLING_MEMO_MAX_BYTES
    first, again = wire.sampling_from_pb(msg), wire.sampling_from_pb(msg)
    assert first == again and first is not again


@pytest.mark.parametrize("bad,fragment", [
    (gen_pb.SamplingParams(temperature=-1.0), "temperature"),
    (gen_pb.SamplingParams(top_p=1.5), "top_p"),
    (gen_pb.SamplingParams(logit_bias={3: float("nan")}), "logit_bias"),
])
def test_invalid_parameters_raise_every_time(bad, fragment):
    for _ in range(2):
        with pytest.raises(ValueError, match=fragment):
            wire.sampling_from_pb(bad)


def test_each_message_is_the_callers_own():
    params = PARAMS[1]
    msg = wire.sampling_to_pb(params)
    msg.temperature = 1.9
    msg.stop.append("x")
    assert wire.sampling_to_pb(params).temperature == 0.75
    assert list(wire.sampling_to_pb(params).stop) == []


def test_plans_carry_the_parameters_of_new_sequences():
    new = [NewSequence(seq_id=i, token_ids=[1, 2, 3], block_ids=[i], num_computed_tokens=0, num_scheduled_tokens=3,
                       sampling=params, num_prompt_tokens=3)
           for i, params in enumerate(PARAMS)]
    msg = wire.plan_to_pb(StepPlan(step_id=4, new_seqs=new))
    msg.new_seqs[0].sampling.temperature = 0.25  # the encoded plan's copy, not the memo's
    decoded = wire.plan_from_pb(gen_pb_roundtrip(msg))
    assert [s.sampling for s in decoded.new_seqs[1:]] == PARAMS[1:]
    assert decoded.new_seqs[0].sampling.temperature == 0.25
    assert wire.plan_from_pb(wire.plan_to_pb(StepPlan(step_id=5, new_seqs=new[:1]))).new_seqs[0].sampling == PARAMS[0]


def gen_pb_roundtrip(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_temperatures_too_small_for_the_sampler_are_greedy():
    """1 / temperature in the sampler's 32-bit floats overflows below about 3e-39 (a draw from
    infinite logits is a random token): below vLLM's 1e-5 a temperature is taken as 0, greedy,
    on both doors (the wire carries the 32-bit value) and offline."""
    from pagewire_common.sampling import GREEDY_BELOW

    for t in (1e-40, 2e-39, 1e-6):
        params = SamplingParams(temperature=t)
        assert params.temperature == 0.0 and params.is_greedy
        msg = wire.sampling_to_pb(SamplingParams())
        msg.temperature = t  # what a gRPC client sends, as a 32-bit float
        assert wire.sampling_from_pb(msg).is_greedy
    assert SamplingParams(temperature=GREEDY_BELOW).temperature == GREEDY_BELOW
    assert not SamplingParams(temperature=0.7).is_greedy
    # a value at the threshold and its 32-bit rounding (what the core decodes) land on one side
    for t in (GREEDY_BELOW, 1.00000001e-05, 9.9999e-06):
        sent = SamplingParams(temperature=t)
        assert wire.sampling_from_pb(wire.sampling_to_pb(sent)).is_greedy == sent.is_greedy, t
