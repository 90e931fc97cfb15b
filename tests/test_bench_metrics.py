"""Metric arithmetic of ``pagewire bench`` on synthetic timestamps (exact values: binary fractions)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagewire.bench.metrics import (
    FIGURES,
    RequestRecord,
    Summary,
    compare,
    e2e_latency,
    inter_token_latencies,
    percentile,
    pooled_metrics,
    ratio,
    run_metrics,
    tpot,
    ttft,
)


def make_record(send=0.0, arrivals=(), end=None, prompt=4, error=None) -> RequestRecord:
    """``arrivals``: (time, number of tokens) per response."""
    times = [t for t, _ in arrivals]
    counts = [k for _, k in arrivals]
    return RequestRecord(
        send_time=send,
        end_time=end if end is not None else (times[-1] if times else send),
        arrival_times=times,
        arrival_counts=counts,
        prompt_tokens=prompt,
        completion_tokens=sum(counts),
        error=error,
    )


# ---- percentiles -------------------------------------------------------------------------------


def test_percentile_interpolates_between_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, ranks 0..3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5  # rank 1.5
    assert percentile(values, 100) == 4.0
    assert percentile([0.0, 8.0], 25) == 2.0  # rank 0.25
    assert percentile([0.0, 1.0, 2.0, 3.0, 4.0], 75) == 3.0  # rank 3 exactly
    assert percentile([0.0, 16.0, 32.0], 75) == 24.0  # rank 1.5
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy_default():
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [rng.expovariate(3.0) for _ in range(n)]
        for q in (0, 1, 50, 90, 95, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_percentile_rejects_bad_input():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_summary_of_values_and_of_nothing():
    s = Summary.of([0.25, 0.75, 0.5, 1.0, 0.0])
    assert (s.count, s.mean, s.p50, s.min, s.max) == (5, 0.5, 0.5, 0.0, 1.0)
    assert s.p95 == 0.95  # rank 3.8: 0.75 + 0.8 * 0.25
    assert s.p99 == pytest.approx(0.99)
    assert Summary.of([]) is None
    assert set(s.to_dict()) == {"count", "mean", "p50", "p95", "p99", "min", "max"}


# ---- per-request definitions -------------------------------------------------------------------


def test_ttft_tpot_itl_e2e_with_packed_responses():
    # tokens: 1 at 0.5; 3 in one response at 0.75; 1 at 1.25; a final response without tokens at 1.5
    rec = make_record(send=0.0, arrivals=[(0.5, 1), (0.75, 3), (1.25, 1), (1.5, 0)])
    assert ttft(rec) == 0.5
    assert tpot(rec) == (1.25 - 0.5) / 4 == 0.1875
    # one arrival followed by k-1 zero gaps; n - 1 gaps in all, summing to last - first token
    assert inter_token_latencies(rec) == [0.25, 0.0, 0.0, 0.5]
    assert sum(inter_token_latencies(rec)) == 0.75
    assert e2e_latency(rec) == 1.5


def test_first_response_packing_and_empty_responses():
    rec = make_record(send=1.0, arrivals=[(1.0625, 0), (1.5, 3), (2.0, 2)])
    assert ttft(rec) == 0.5  # the empty response is not a token arrival
    assert inter_token_latencies(rec) == [0.0, 0.0, 0.5, 0.0]
    assert tpot(rec) == 0.5 / 4


def test_single_token_and_no_token_requests():
    one = make_record(arrivals=[(0.25, 1)])
    assert ttft(one) == 0.25
    assert tpot(one) is None
    assert inter_token_latencies(one) == []
    none = make_record(arrivals=[(0.25, 0)])
    assert ttft(none) is None and tpot(none) is None and inter_token_latencies(none) == []


def test_mean_itl_of_a_request_equals_its_tpot():
    rec = make_record(arrivals=[(0.125, 2), (0.5, 1), (0.625, 4), (1.0, 1)])
    gaps = inter_token_latencies(rec)
    assert len(gaps) == rec.num_received_tokens - 1
    assert sum(gaps) / len(gaps) == tpot(rec)


# ---- runs --------------------------------------------------------------------------------------


def test_run_metrics_counts_throughput_and_pools_itl():
    a = make_record(send=0.0, arrivals=[(0.5, 1), (1.0, 1)], end=1.0, prompt=8)  # 2 tokens
    b = make_record(send=0.5, arrivals=[(0.75, 2), (1.25, 2)], end=1.5, prompt=4)  # 4 tokens
    failed = make_record(send=0.0, arrivals=[(0.25, 1)], prompt=100, error="UNAVAILABLE")
    m = run_metrics([a, b, failed], duration_s=2.0)
    assert (m.num_requests, m.num_failed, m.errors) == (3, 1, {"UNAVAILABLE": 1})
    assert (m.prompt_tokens, m.completion_tokens) == (12, 6)  # failed requests do not count
    assert m.completion_tokens_per_s == 3.0
    assert m.total_tokens_per_s == 9.0
    assert m.requests_per_s == 1.0
    assert m.ttft.count == 2 and m.ttft.mean == (0.5 + 0.25) / 2
    assert (m.tpot.min, m.tpot.max) == (0.5 / 3, 0.5)
    assert m.itl.count == 1 + 3
    assert sorted([m.itl.min, m.itl.max]) == [0.0, 0.5]
    assert m.itl.mean == (0.5 + 0.0 + 0.5 + 0.0) / 4
    assert (m.e2e.min, m.e2e.max) == (1.0, 1.0)
    d = m.to_dict()
    assert d["completion_tokens"] == 6 and d["ttft_s"]["count"] == 2 and d["errors"] == {"UNAVAILABLE": 1}


def test_whole_request_runs_have_no_per_token_metrics():
    batch = [RequestRecord(send_time=1.0, end_time=3.0, prompt_tokens=5, completion_tokens=8) for _ in range(4)]
    m = run_metrics(batch, duration_s=4.0, per_token=False)
    assert m.ttft is None and m.tpot is None and m.itl is None
    assert m.e2e.p50 == 2.0
    assert m.completion_tokens_per_s == 8.0
    assert m.to_dict()["itl_s"] is None


def test_pooled_metrics_sum_wall_times_and_keep_busiest_client():
    r1 = [make_record(arrivals=[(0.5, 4)], prompt=2)]
    r2 = [make_record(arrivals=[(0.25, 4)], prompt=2)]
    m = pooled_metrics([(r1, 1.0), (r2, 3.0)], client_cpu_fractions=[0.5, 0.75])
    assert m.duration_s == 4.0
    assert m.completion_tokens_per_s == 2.0
    assert m.ttft.p50 == 0.375
    assert m.client_cpu_fraction == 0.75


def test_zero_duration_gives_zero_rates():
    m = run_metrics([], duration_s=0.0)
    assert (m.completion_tokens_per_s, m.requests_per_s) == (0.0, 0.0)
    assert m.e2e is None


# ---- ratios ------------------------------------------------------------------------------------


def test_ratio_is_above_one_when_ours_is_better():
    assert ratio(300.0, 100.0, higher_is_better=True) == 3.0  # throughput: ours / baseline
    assert ratio(0.25, 1.0, higher_is_better=False) == 4.0  # latency: baseline / ours
    assert ratio(50.0, 100.0, higher_is_better=True) == 0.5
    assert ratio(None, 1.0, higher_is_better=True) is None
    assert ratio(1.0, None, higher_is_better=False) is None
    assert ratio(1.0, 0.0, higher_is_better=True) is None
    assert ratio(0.0, 1.0, higher_is_better=False) is None


def test_compare_covers_every_figure_and_marks_missing_ones():
    ours = run_metrics([make_record(arrivals=[(0.25, 1), (0.5, 1)], end=0.5)], duration_s=1.0)
    static = run_metrics(
        [RequestRecord(send_time=0.0, end_time=1.0, prompt_tokens=4, completion_tokens=2)], duration_s=2.0,
        per_token=False,
    )
    r = compare(ours, static)
    assert set(r) == {f.key for f in FIGURES}
    assert r["completion_tokens_per_s"] == 2.0  # 2 tok/s vs 1 tok/s
    assert r["total_tokens_per_s"] == 2.0
    assert r["e2e_p50"] == 2.0  # 1.0 s vs 0.5 s
    assert r["ttft_p50"] is None and r["itl_p99"] is None
