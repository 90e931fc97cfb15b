"""Sampling and output controls over gRPC (worker, core and API server as processes), against the
offline API, which ``test_sampling_controls`` checks against transformers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagewire import LLM, SamplingParams
from pagewire_common import wire
from pagewire_common.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import start_scheduler, start_worker, stub
from tests.test_services import assert_all_blocks_free
from tests.tiny_models import sample_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def services(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc")
    worker, worker_addr = start_worker(model_dir, tmp, extra=["--block-size", "4", "--num-kv-blocks", "300"])
    sched, addr = start_scheduler(worker_addr, tmp, extra=["--max-num-batched-tokens", "32", "--max-num-seqs", "16"])
    yield addr
    sched.stop()
    worker.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(model_dir, block_size=4, num_kv_blocks=300, max_num_batched_tokens=32, max_num_seqs=16)


def mixed_params(n: int) -> list[SamplingParams]:
    kinds = [
        dict(repetition_penalty=1.8, top_logprobs=2),
        dict(logit_bias={7: 4.0, 11: -100.0}),
        dict(min_tokens=8, stop_token_ids=[5, 9, 13]),
        dict(presence_penalty=0.8, frequency_penalty=0.6, logprobs=True, top_logprobs=5),
        dict(),
        dict(top_logprobs=20, logprobs=True),
    ]
    return [SamplingParams(temperature=0, max_tokens=16, **kinds[i % len(kinds)]) for i in range(n)]


def generate_concurrently(addr: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[list]:
    """Every prompt as its own Generate call, all at once; each call's responses, in order."""
    s = stub(addr)

    def one(i):
        return list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompts[i], sampling=wire.sampling_to_pb(params[i]))))

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))

def test_mixed_settings_in_one_batch_match_the_offline_api(services, offline, model_dir):
    prompts = sample_prompts(model_dir, n=12)
    params = mixed_params(len(prompts))
    expected = offline.generate(prompts, params)
    results = generate_concurrently(services, prompts, params)
    for i, responses in enumerate(results):
        sp, want = params[i], expected[i]
        ids = [t for r in responses for t in r.token_ids]
        assert ids == want.token_ids, f"prompt {i} ({sp})"
        assert responses[-1].usage.completion_tokens == len(ids)
        tops = [t for r in responses for t in r.top_logprobs]
        if sp.top_logprobs:
            assert len(tops) == len(ids)
            for got, (want_ids, want_lps) in zip(tops, want.top_logprobs):
                assert list(got.token_ids) == want_ids and len(want_ids) == sp.top_logprobs
                assert list(got.logprobs) == pytest.approx(want_lps, abs=1e-5)
        else:
            assert tops == []
        lps = [lp for r in responses for lp in r.logprobs]
        assert lps == (pytest.approx(want.logprobs, abs=1e-5) if sp.logprobs else [])
    assert_all_blocks_free(services)


@pytest.mark.parametrize("sampling, fragment", [
    (pb.SamplingParams(top_logprobs=21), "top_logprobs"),
    (pb.SamplingParams(repetition_penalty=-0.5), "repetition_penalty"),
    (pb.SamplingParams(logit_bias={10**6: 1.0}), "outside the vocabulary"),
    (pb.SamplingParams(regex="a+", grammar="start: \"a\""), "at most one"),
    (pb.SamplingParams(regex="[a-"), "invalid regex"),
    (pb.SamplingParams(json_schema='{"type": "objectx"}'), "invalid json_schema"),
    (pb.SamplingParams(n=17), "max_num_seqs"),
    (pb.SamplingParams(stop=[f"s{i}" for i in range(10_000)]), f"at most {MAX_STOP_STRINGS} stop strings"),
    (pb.SamplingParams(stop=["x" * MAX_STOP_CHARS, "y"]), f"at most {MAX_STOP_CHARS} characters"),
])
def test_bad_values_are_invalid_argument_and_nothing_is_queued(services, sampling, fragment):
    s = stub(services)
    before = s.GetStats(pb.StatsRequest()).num_requests_rejected
    with pytest.raises(grpc.RpcError) as e:
        list(s.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in e.value.details()
    stats = s.GetStats(pb.StatsRequest())
    assert stats.num_requests_rejected == before + 1 and stats.num_waiting == 0 and stats.num_running == 0


def test_the_largest_stop_set_is_served_and_cuts_every_sample(services, model_dir):
    """MAX_STOP_STRINGS strings of MAX_STOP_CHARS characters in all, one of them in the greedy text:
    each of n = 2 samples is cut before its first occurrence."""
    prompt = sample_prompts(model_dir, n=8)[2]
    s = stub(services)
    plain = wire.sampling_to_pb(SamplingParams(temperature=0, max_tokens=24))
    text = "".join(r.text for r in s.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=plain)))
    assert len(text) >= 8
    stop = text[4:7]
    never = [f"\x00{i:04d}".ljust(64, "#") for i in range(MAX_STOP_STRINGS - 1)]
    sp = SamplingParams(temperature=0, max_tokens=24, n=2, stop=[*never, stop])
    assert sum(map(len, sp.stop)) <= MAX_STOP_CHARS
    responses = list(s.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=wire.sampling_to_pb(sp))))
    for index in range(2):
        mine = [r for r in responses if r.index == index]
        assert "".join(r.text for r in mine) == text[:text.find(stop)]
        assert mine[-1].finish_reason == pb.STOP
    assert_all_blocks_free(services)


def test_n_samples_stream_on_their_own_and_match_the_offline_api(services, offline, model_dir):
    prompt = sample_prompts(model_dir, n=8)[5]
    sp = SamplingParams(temperature=2.0, seed=11, max_tokens=10, n=4, top_logprobs=2)
    expected = offline.generate([prompt], sp)[0].samples
    responses = list(stub(services).Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                                sampling=wire.sampling_to_pb(sp))))
    for index in range(4):
        mine = [r for r in responses if r.index == index]
        ids = [t for r in mine for t in r.token_ids]
        assert ids == expected[index].token_ids
        assert len([t for r in mine for t in r.top_logprobs]) == len(ids)
        finals = [r for r in mine if r.finish_reason != pb.UNSPECIFIED]
        assert len(finals) == 1 and finals[0] is mine[-1]
        assert finals[0].usage.completion_tokens == len(ids) and finals[0].usage.prompt_tokens == len(prompt)
    assert len({tuple(s.token_ids) for s in expected}) == 4
    assert_all_blocks_free(services)


def test_structured_outputs_match_the_offline_api_and_their_grammar(services, offline, model_dir):
    """JSON schema, regex and GBNF requests (one with n = 3) beside unconstrained ones, over gRPC:
    the same tokens as the offline API (seeded), text that follows the grammar, ending with STOP."""
    import json
    import re

    from tests.test_structured_output import GBNF, GBNF_PATTERN, REGEX, SCHEMA, check_schema

    prompts = sample_prompts(model_dir, n=8)
    kinds = [dict(json_schema=SCHEMA), dict(regex=REGEX), dict(grammar=GBNF), {}, dict(json_schema=SCHEMA, n=3)]
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=80, **kinds[i % len(kinds)])
              for i in range(len(prompts))]
    expected = offline.generate(prompts, params)
    results = generate_concurrently(services, prompts, params)
    for i, responses in enumerate(results):
        sp = params[i]
        want = expected[i].samples or [expected[i]]
        for index in range(sp.n):
            mine = [r for r in responses if r.index == index]
            ids = [t for r in mine for t in r.token_ids]
            text = "".join(r.text for r in mine)
            assert ids == want[index].token_ids and text == want[index].text, f"prompt {i} sample {index}"
            if sp.structured_output is None:
                continue
            assert mine[-1].finish_reason == pb.STOP
            kind, _ = sp.structured_output
            if kind == "json_schema":
                check_schema(json.loads(text), SCHEMA)
            else:
                assert re.fullmatch(REGEX if kind == "regex" else GBNF_PATTERN, text), text
    assert_all_blocks_free(services)
