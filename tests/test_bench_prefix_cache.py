"""``pagewire bench --prefix-groups G --prefix-len L``: the shared-prefix prompts, the hit-rate
arithmetic, the flags' errors, and the server's hit rate end to end with the null worker."""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import pytest

from pagewire.bench.prefix_cache import (
    PrefixCacheCounts,
    group_of,
    ideal_hit_rate,
    ideal_hit_tokens,
    prefix_cache_dict,
    prefix_cache_lines,
    prefix_group_prompts,
)
from tests.test_bench_e2e import bench_main, explain, run_bench
from tests.tiny_models import get_tiny_model

ALLOWED = list(range(100, 1100))


def make_prompts(seed: int = 0, n: int = 10, groups: int = 3, prefix_len: int = 5, suffix=(4, 4)):
    return prefix_group_prompts(n, groups, prefix_len, suffix, ALLOWED, random.Random(seed))


# ---- prompts ------------------------------------------------------------------------------------


def test_requests_share_their_groups_prefix_round_robin():
    prompts = make_prompts(n=10, groups=3, prefix_len=5)
    assert [group_of(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    prefixes = [prompts[g][:5] for g in range(3)]
    assert len({tuple(p) for p in prefixes}) == 3
    for i, p in enumerate(prompts):
        assert len(p) == 5 + 4  # exactly L tokens of prefix, then the --prompt-len suffix
        assert p[:5] == prefixes[i % 3]
        assert all(t in ALLOWED for t in p)
    suffixes = [tuple(p[5:]) for p in prompts]
    assert len(set(suffixes)) == len(prompts)


def test_suffix_lengths_follow_the_prompt_len_range():
    prompts = make_prompts(n=50, groups=2, prefix_len=7, suffix=(1, 3))
    assert {len(p) - 7 for p in prompts} == {1, 2, 3}


def test_prompts_are_deterministic_by_seed():
    assert make_prompts(seed=1) == make_prompts(seed=1)
    assert make_prompts(seed=1) != make_prompts(seed=2)


def test_one_group_shares_one_prefix():
    prompts = make_prompts(n=4, groups=1, prefix_len=3, suffix=(2, 2))
    assert len({tuple(p[:3]) for p in prompts}) == 1


def test_too_few_distinct_suffixes_is_an_error():
    with pytest.raises(ValueError, match="distinct suffixes"):
        prefix_group_prompts(3, 1, 4, (1, 1), [7, 8], random.Random(0))


# ---- hit-rate arithmetic --------------------------------------------------------------------------


def test_ideal_hit_tokens_count_full_prefix_blocks_of_all_but_each_groups_first():
    # 8 requests, 2 groups: 6 repeat a prefix; 40 tokens of prefix = 2 full blocks of 16
    assert ideal_hit_tokens(8, 2, 40, 16) == 6 * 32
    assert ideal_hit_tokens(8, 2, 15, 16) == 0  # no full block in the prefix
    assert ideal_hit_tokens(2, 4, 64, 16) == 0  # every request the first of its group
    assert ideal_hit_rate([[48] * 8], 2, 40, 16) == 192 / 384
    # pooled over runs: each run has its own first request of each group
    assert ideal_hit_rate([[48] * 8, [48] * 4], 2, 40, 16) == (192 + 64) / (384 + 192)
    assert ideal_hit_rate([], 2, 40, 16) == 0.0


def test_counts_over_a_run_and_pooled():
    before, after = PrefixCacheCounts(100, 40), PrefixCacheCounts(1100, 790)
    run = after.since(before)
    assert run == PrefixCacheCounts(1000, 750) and run.hit_rate == 0.75
    assert PrefixCacheCounts(0, 0).hit_rate is None  # prefix cache off: nothing looked up
    entry = prefix_cache_dict([run, PrefixCacheCounts(1000, 250)])
    assert entry == {
        "known": True,
        "runs": [{"queried_tokens": 1000, "hit_tokens": 750, "hit_rate": 0.75},
                 {"queried_tokens": 1000, "hit_tokens": 250, "hit_rate": 0.25}],
        "aggregate": {"queried_tokens": 2000, "hit_tokens": 1000, "hit_rate": 0.5},
    }


def test_summary_lines():
    doc = {"ideal_hit_rate": 0.6, "engines": {
        "pagewire": prefix_cache_dict([PrefixCacheCounts(2000, 1000)]),
        "pagewire-openai": {"known": False, "reason": "GetStats failed"},
        "pagewire-penalties": prefix_cache_dict([PrefixCacheCounts(0, 0)]),
    }}
    assert prefix_cache_lines(doc) == [
        ("prefix cache hit rate, pagewire: 50.0% (1,000 / 2,000 prompt tokens, the server's counters); "
         "ideal for this workload 60.0%"),
        "prefix cache hit rate, pagewire-openai: not known (GetStats failed)",
        ("prefix cache hit rate, pagewire-penalties: n/a (0 / 0 prompt tokens: the server looked nothing up, its "
         "prefix cache is off); ideal for this workload 60.0%"),
    ]


def test_unreachable_get_stats_makes_the_column_not_known():
    from pagewire.bench.cli import validate_args
    from pagewire.bench.session import Bench
    from pagewire.cli import build_parser

    class NoStats:
        addr = "127.0.0.1:1"
        calls = 0

        async def get_stats(self, timeout):
            self.calls += 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="no GetStats here")

    args = build_parser().parse_args(["bench", "--addr", "127.0.0.1:1", "--backend", "openai"])
    validate_args(args)
    bench = Bench(args)
    bench.prefix_cache = {("openai", "greedy"): []}
    client = NoStats()
    assert asyncio.run(bench.read_prefix_cache(client, "openai", "greedy")) is None
    assert asyncio.run(bench.read_prefix_cache(client, "openai", "greedy")) is None
    assert client.calls == 1  # asked once, then known to fail
    doc = bench.prefix_cache_dict()
    assert doc == {"ideal_hit_rate": None, "engines": {"pagewire": {
        "known": False, "reason": "GetStats over gRPC at 127.0.0.1:1 failed: UNIMPLEMENTED: no GetStats here"}}}


# ---- flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["--prefix-groups", "0", "--prefix-len", "8"],
                                  ["--prefix-groups", "2", "--prefix-len", "0"],
                                  ["--prefix-groups", "x", "--prefix-len", "8"]])
def test_bad_prefix_values_are_rejected_by_the_parser(capsys, argv):
    from pagewire.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--prefix-" in err and ("must be >= 1" in err or "invalid" in err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prefix-groups", "2"], "--prefix-groups and --prefix-len go together"),
        (["--prefix-len", "64"], "--prefix-groups and --prefix-len go together"),
        (["--prefix-groups", "2", "--prefix-len", "8", "--prompt", "hi"], "not --prompt"),
    ],
)
def test_bad_prefix_combinations_are_explained(capsys, argv, message):
    code, err = bench_main(capsys, *argv)
    assert code == 2 and message in err


# ---- end to end -----------------------------------------------------------------------------------


def prefix_bench(tmp_path, *extra: str) -> tuple[dict, str]:
    out_json, server_log = tmp_path / "prefix.json", tmp_path / "server.log"
    proc = run_bench(
        "--serve", "--server-log", str(server_log), "--worker", "null", "--model", str(get_tiny_model("llama-gqa")),
        "--prefix-groups", "2", "--prefix-len", "64", "--prompt-len", "8", "--num-requests", "32",
        "--concurrency", "4", "--max-new-tokens", "4", "--ignore-eos", "--json", str(out_json), *extra,
    )
    assert proc.returncode == 0, explain(proc, server_log)
    return json.loads(out_json.read_text()), proc.stdout


@pytest.mark.slow
def test_shared_prefixes_hit_the_servers_prefix_cache(tmp_path):
    doc, stdout = prefix_bench(tmp_path)
    cache = doc["prefix_cache"]
    # 30 of 32 requests repeat a prefix of 4 full blocks of 16: 30 * 64 of 32 * 72 prompt tokens
    assert cache["ideal_hit_rate"] == pytest.approx(30 * 64 / (32 * 72))
    ours = cache["engines"]["pagewire"]
    assert ours["known"] is True and len(ours["runs"]) == 1
    agg = ours["aggregate"]
    assert agg["queried_tokens"] == 32 * 72  # the measured run only: the warmup's lookups do not count
    assert 0 < agg["hit_rate"] <= cache["ideal_hit_rate"]
    assert agg["hit_tokens"] % 16 == 0
    assert doc["config"]["prefix_groups"] == 2 and doc["config"]["prefix_len"] == 64
    assert "prefix cache hit rate, pagewire: " in stdout and "ideal for this workload 83.3%" in stdout


@pytest.mark.slow
def test_without_the_prefix_cache_nothing_hits(tmp_path):
    doc, stdout = prefix_bench(tmp_path, "--no-prefix-cache")
    agg = doc["prefix_cache"]["engines"]["pagewire"]["aggregate"]
    assert agg["hit_tokens"] == 0 and agg["hit_rate"] is None
    assert "prefix cache hit rate, pagewire: n/a" in stdout
