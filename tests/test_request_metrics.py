"""The per-request metrics of an API server, fed directly (the served counts are in
test_openai_http.py)."""

from __future__ import annotations

import pytest
from prometheus_client import values
from prometheus_client.parser import text_string_to_metric_families

from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.metrics import RequestMetrics, exposition


def _itl(metrics: RequestMetrics) -> tuple[float, float]:
    """(count, sum) of the inter-token-latency histogram."""
    values = {s.name: s.value for family in metrics.registry.collect() for s in family.samples}
    return values["pagewire:inter_token_latency_seconds_count"], values["pagewire:inter_token_latency_seconds_sum"]


@pytest.mark.parametrize("deltas", [[1, 1, 1, 1, 1], [2, 3], [5], [1, 4], [3, 1, 1]])
def test_every_token_after_a_requests_first_is_one_inter_token_latency_however_grouped(monkeypatch, deltas):
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = RequestMetrics("m")
    for i, n in enumerate(deltas):
        metrics.tokens(n, None if i == 0 else 0.5)
    count, total = _itl(metrics)
    assert count == sum(deltas) - 1
    assert total == pytest.approx(0.5 * (len(deltas) - 1))  # the first delta's extra tokens took no time


def _series_model_names(text: bytes) -> dict[str, set[str]]:
    """Each family's ``model_name`` labels in a scrape."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            names.setdefault(family.name, set()).add(s.labels.get("model_name"))
    return names


def _record_one_request(metrics: RequestMetrics) -> None:
    metrics.queue_time(0.01, 5)
    metrics.first_token(0.02)
    metrics.tokens(1, None)
    metrics.tokens(2, 0.01)
    metrics.finished("length", 0.05)


@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_scrape_has_only_the_served_models_series(monkeypatch, tmp_path, multiprocess):
    """Nothing is published under an empty ``model_name`` while the model is unknown, so once it
    is known every family, the request figures and the core's, has that model's series only."""
    if multiprocess:  # as with several API servers: children are written to files as they are made
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    else:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = RequestMetrics()  # as the API server makes it, before the worker says which model
    stats = pb.Stats(num_running=1, num_waiting=2, num_total_blocks=10, num_free_blocks=4)
    before = _series_model_names(exposition(metrics, stats, None))
    assert all(names == set() for names in before.values()), before  # families, no series
    metrics.set_model_name("m")
    _record_one_request(metrics)
    after = _series_model_names(exposition(metrics, stats, "m"))
    expected = {"time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                "request_queue_time_seconds", "prompt_tokens", "generation_tokens", "request_success",
                "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits"}
    assert {"pagewire:" + name for name in expected} <= after.keys()
    assert set().union(*after.values()) == {"m"}
