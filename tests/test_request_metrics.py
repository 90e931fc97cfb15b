"""The per-request metrics of an API server, fed directly (the served counts are in
test_openai_http.py)."""

from __future__ import annotations

import pytest

from scheduler_svc.api.metrics import RequestMetrics


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
