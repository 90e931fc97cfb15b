"""The per-request metrics of an API server, fed directly (the served counts are in
test_openai_http.py)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Histogram, values
from prometheus_client.parser import text_string_to_metric_families

from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.metrics import ITL_BUCKETS, RequestMetrics, exposition


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


def _token_figures(metrics: RequestMetrics) -> dict[tuple[str, str | None], float]:
    """The inter-token-latency and generated-token samples of ``metrics``' model ((name, le) -> value)."""
    return {(s.name, s.labels.get("le")): s.value for family in metrics.registry.collect() for s in family.samples
            if s.labels.get("model_name") == metrics.model_name and not s.name.endswith("_created")
            and ("inter_token" in s.name or "generation_tokens" in s.name)}


@pytest.mark.parametrize("multiprocess", [False, True])
def test_token_figures_are_written_once_a_turn_as_observe_would_write_them(monkeypatch, tmp_path, multiprocess):
    """Inside the event loop the per-token figures wait for the end of the loop's turn, then land
    as one ``observe`` per inter-token latency would have put them: each bucket (bounds included:
    an observation equal to a bound is in its bucket), the count, the sum and the token counter.
    (In multiprocess mode one process's values of a series share one file entry, so each instance
    here records under a model name of its own.)"""
    if multiprocess:
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    else:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    deltas = [(1, None), (1, 0.005), (3, 0.015), (2, 0.3), (1, 0.005), (1, 100.0), (4, None), (1, 0.0001)]
    reference = RequestMetrics("outside")
    for n, seconds in deltas:  # outside a loop: written at once
        reference.tokens(n, seconds)
    expected = _token_figures(reference)
    assert expected[("pagewire:generation_tokens_total", None)] == sum(n for n, _ in deltas)
    one_by_one = Histogram("h", "", buckets=ITL_BUCKETS, registry=CollectorRegistry())
    for n, seconds in deltas:
        for _ in range(n - 1 if seconds is None else n):
            one_by_one.observe(0.0 if seconds is None else seconds / n)
    observed = {(s.name.replace("h_", "pagewire:inter_token_latency_seconds_"), s.labels.get("le")): s.value
                for family in one_by_one.collect() for s in family.samples if not s.name.endswith("_created")}
    assert {key: value for key, value in expected.items() if "inter_token" in key[0]} == pytest.approx(observed)

    async def feed(metrics: RequestMetrics) -> tuple[dict, dict]:
        for n, seconds in deltas:
            metrics.tokens(n, seconds)
        before = _token_figures(metrics)
        await asyncio.sleep(0)  # the end of this turn
        return before, _token_figures(metrics)

    before, after = asyncio.run(feed(RequestMetrics("in-loop")))
    assert set(before.values()) == {0.0}  # nothing written within the turn
    assert after == pytest.approx(expected)

    metrics = RequestMetrics("scraped")
    metrics._flush_scheduled = True  # as if the turn had not ended yet: a scrape writes what is pending
    for n, seconds in deltas:
        metrics.tokens(n, seconds)
    assert set(_token_figures(metrics).values()) == {0.0}
    exposition(metrics, None, "scraped")
    assert _token_figures(metrics) == pytest.approx(expected)


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
    stats = [(0, pb.Stats(num_running=1, num_waiting=2, num_total_blocks=10, num_free_blocks=4))]
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


class _Finishes:
    """The metrics calls an ``ApiRequest`` makes, with its finishes kept by reason."""

    def __init__(self):
        self.reasons: list[str] = []

    def finished(self, reason: str, seconds: float) -> None:
        self.reasons.append(reason)

    def first_token(self, seconds: float) -> None:
        pass

    def tokens(self, n: int, itl: float | None) -> None:
        pass

    def queue_time(self, seconds: float, num_prompt_tokens: int) -> None:
        pass


class _Link:
    """The part of a ``CoreLink`` an ``ApiRequest`` uses: it keeps the request's outbox and the
    ids aborted."""

    def __init__(self):
        self.metrics = _Finishes()
        self.aborted: list[int] = []

    def submit(self, request_id, prompt_token_ids, sampling, outbox, request) -> int:
        self.outbox = outbox
        return 100

    def abort(self, request_id: int) -> None:
        self.aborted.append(request_id)

    def note_undelivered(self, outbox) -> None:
        pass

    def delivered(self, outbox) -> None:
        pass


def test_samples_cut_off_count_one_by_one_as_finished_ones_do():
    """n = 3, one sample finished: an abort counts the two others, as the core counts its aborts
    (one per sample); a failure counts them as errors, after handing on what came before it."""
    import grpc

    from pagewire_common.requests import FinishReason, TextDelta
    from pagewire_common.sampling import SamplingParams
    from scheduler_svc.api.request import ApiRequest, Failure, RequestError

    def finished_delta(index: int) -> TextDelta:
        return TextDelta("r", [7], "x", finish_reason=FinishReason.LENGTH, index=index)

    async def aborted():
        link = _Link()
        request = ApiRequest(link, "r", [1, 2], SamplingParams(n=3, max_tokens=1))
        link.outbox.put_nowait(finished_delta(0))
        async for _ in request:
            break  # the client goes away after the first sample's end
        request.close()
        return link

    link = asyncio.run(aborted())
    assert link.metrics.reasons == ["length", "abort", "abort"] and link.aborted == [100, 101, 102]

    async def failed():
        link = _Link()
        request = ApiRequest(link, "r", [1, 2], SamplingParams(n=3, max_tokens=1))
        request.started()  # the core scheduled it
        link.outbox.put_nowait(finished_delta(1))
        link.outbox.put_nowait(Failure(grpc.StatusCode.UNAVAILABLE, "worker unavailable"))
        got = []
        with pytest.raises(RequestError) as err:
            async for items in request:
                got.extend(items)
        request.close()
        return link, got, err.value

    link, got, error = asyncio.run(failed())
    assert [d.index for d in got] == [1] and error.code == grpc.StatusCode.UNAVAILABLE
    assert link.metrics.reasons == ["length", "error", "error"] and link.aborted == []

    async def ended_before_any_token(code: grpc.StatusCode) -> _Link:
        link = _Link()
        request = ApiRequest(link, "r", [1, 2], SamplingParams(n=2, max_tokens=1))
        link.outbox.put_nowait(Failure(code, "ended"))
        with pytest.raises(RequestError):
            async for _ in request:
                pass
        request.close()
        return link

    # the public Abort: the core ends each sample CANCELLED
    assert asyncio.run(ended_before_any_token(grpc.StatusCode.CANCELLED)).metrics.reasons == ["abort", "abort"]
    # the core had no room: a refusal, not a finished request
    link = asyncio.run(ended_before_any_token(grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert link.metrics.reasons == [] and link.aborted == []


def test_each_core_has_its_own_series_so_no_counter_goes_down(monkeypatch):
    """Two cores: one series each (label engine). When one stops answering its series goes, and
    the other's counters are what they were: a sum over the cores that answer would fall."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    metrics = RequestMetrics("m")

    def scrape(per_core):
        families = text_string_to_metric_families(exposition(metrics, per_core, "m").decode())
        return {(s.name, s.labels["engine"]): s.value for f in families for s in f.samples
                if "engine" in s.labels}

    first = pb.Stats(num_preemptions=3, num_prefix_cache_queried_tokens=196, num_prefix_cache_hit_tokens=86,
                     num_running=2, num_total_blocks=10, num_free_blocks=5)
    second = pb.Stats(num_preemptions=1, num_prefix_cache_queried_tokens=72, num_prefix_cache_hit_tokens=30,
                      num_total_blocks=10, num_free_blocks=10)
    both = scrape([(0, first), (1, second)])
    assert both[("pagewire:prefix_cache_queries_total", "0")] == 196
    assert both[("pagewire:prefix_cache_queries_total", "1")] == 72
    assert both[("pagewire:num_requests_running", "0")] == 2 and both[("pagewire:kv_cache_usage_perc", "0")] == 0.5
    alone = scrape([(1, second)])  # core 0 stopped answering
    assert not any(engine == "0" for _, engine in alone)
    assert all(alone[key] == value for key, value in both.items() if key[1] == "1")
