"""Prometheus metrics, served at ``GET /metrics`` by every API server.

Two sources, one exposition:
- **per request**, recorded by the API server that streams it (either door): time to first token,
  inter-token latency, end-to-end latency, time in the queue (histograms); prompt and generation
  tokens and finished requests by reason (counters). With several API servers the scheduler gives
  them one ``PROMETHEUS_MULTIPROC_DIR``, so whichever server a scrape reaches reports the sum of
  all of them (prometheus_client's multiprocess mode).
- **the cores' figures**, read from each core's ``CoreStats`` at each scrape: requests running and
  waiting, KV cache usage (gauges), preemptions and prefix-cache lookups (counters, cumulative
  since the core started), one series per engine core (label ``engine``: its index in the API
  server's list of cores, as vLLM labels its engines), so a core that stops or restarts moves
  only its own series and no summed counter ever goes down.

The names follow vLLM's (``pagewire:`` instead of ``vllm:``, the same ``model_name`` label), so
dashboards built for it carry over.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagewire_common.envs import metrics_multiprocess_dir as multiprocess_dir
from pagewire_common.v1 import generation_pb2 as pb

PREFIX = "pagewire:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# bucket bounds as vLLM's, with finer low ones for fast accelerators
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class RequestMetrics:
    """The per-request families of one API-server process, in a registry of its own (in
    multiprocess mode the values also go to this process's files in the shared folder).

    A family's series exist from ``set_model_name`` on: creating a labelled child publishes it at
    zero (in multiprocess mode it is written to this process's files at once), so none is made
    before the served model is known. No request is recorded before then: the API server opens
    none until it has the model.

    The per-token figures (generated tokens, inter-token latencies) are summed in plain Python and
    written to their metric values once per turn of the event loop (``flush``; a scrape flushes
    first), not once per token: a value's write takes a lock and, in multiprocess mode, a
    ``getpid`` system call and a write to its file, and a step's deltas reach their handlers in one
    turn."""

    def __init__(self, model_name: str | None = None):
        self.model_name: str | None = None
        self.registry = registry = CollectorRegistry()
        kw = dict(labelnames=("model_name",), registry=registry)
        self._ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from a request's arrival at the "
                               "API server to its first token.", buckets=TTFT_BUCKETS, **kw)
        self._itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request "
                              "(tokens that arrive together share the time since the previous delta).",
                              buckets=ITL_BUCKETS, **kw)
        self._e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from a request's arrival to its "
                              "last token.", buckets=LATENCY_BUCKETS, **kw)
        self._queue = Histogram(PREFIX + "request_queue_time_seconds", "Time from a request's arrival to its "
                                "first scheduling by the core.", buckets=LATENCY_BUCKETS, **kw)
        self._prompt = Counter(PREFIX + "prompt_tokens", "Prompt tokens of the requests scheduled.", **kw)
        self._generation = Counter(PREFIX + "generation_tokens", "Tokens generated and streamed.", **kw)
        labels = ("model_name", "finished_reason")
        self._success = Counter(PREFIX + "request_success",
                                "Requests finished, one per sample, by reason (stop, length; abort: the client "
                                "cancelled or went away; error: the server failed it after taking it on).",
                                labelnames=labels, registry=registry)
        self._pending_tokens = 0
        self._pending_itl: dict[float, int] = {}  # an inter-token latency -> how many tokens took it
        self._flush_scheduled = False
        if model_name is not None:
            self.set_model_name(model_name)

    def set_model_name(self, name: str) -> None:
        """Record under ``name`` from now on (the series of an earlier name keep their values)."""
        if name == self.model_name:
            return
        if self.model_name is not None:
            self.flush()  # what is pending belongs to the earlier name
        self.model_name = name
        self.ttft = self._ttft.labels(name)
        self.itl = self._itl.labels(name)
        self.e2e = self._e2e.labels(name)
        self.queue = self._queue.labels(name)
        self.prompt = self._prompt.labels(name)
        self.generation = self._generation.labels(name)

    # ---- called by ApiRequest ------------------------------------------------------------------

    def queue_time(self, seconds: float, num_prompt_tokens: int) -> None:
        self.queue.observe(seconds)
        self.prompt.inc(num_prompt_tokens)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def tokens(self, n: int, seconds_since_last: float | None) -> None:
        """``n`` tokens arrived together; the first delta has no previous one. Every token after a
        request's first is one inter-token latency, however the tokens were grouped: the tokens
        that came with the first took no time after it."""
        self._pending_tokens += n
        if seconds_since_last is None:
            each, n = 0.0, n - 1
        else:
            each = seconds_since_last / n
        if n > 0:
            self._pending_itl[each] = self._pending_itl.get(each, 0) + n
        if not self._flush_scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # called outside the event loop: write at once
                self.flush()
                return
            self._flush_scheduled = True
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the pending token counts and inter-token latencies to their metric values: what
        one ``observe`` per latency would write, in one write per bucket touched."""
        self._flush_scheduled = False
        if self._pending_tokens:
            self.generation.inc(self._pending_tokens)
            self._pending_tokens = 0
        if self._pending_itl:
            _observe_many(self.itl, self._pending_itl)
            self._pending_itl = {}

    def finished(self, reason: str, seconds: float) -> None:
        self.e2e.observe(seconds)
        self._success.labels(self.model_name, reason).inc()


def _observe_many(histogram, counts: dict[float, int]) -> None:
    """``histogram.observe(value)`` ``count`` times for each value: each value's count added to the
    bucket ``observe`` would pick (the first bound at or above it) and value x count to the sum.
    prometheus_client has no public call for this; its histogram child keeps ``_upper_bounds``,
    ``_buckets`` (one value per bound, not cumulative) and ``_sum`` (tests/test_request_metrics.py
    checks the result against plain ``observe`` calls)."""
    bounds, buckets = histogram._upper_bounds, histogram._buckets
    per_bucket = [0] * len(bounds)
    total = 0.0
    for value, count in counts.items():
        per_bucket[bisect_left(bounds, value)] += count
        total += value * count
    histogram._sum.inc(total)
    for bucket, count in zip(buckets, per_bucket):
        if count:
            bucket.inc(count)


class CoreFigures:
    """A collector for one scrape: each core's gauges and counters from its ``Stats``."""

    def __init__(self, per_core: list[tuple[int, pb.Stats]], model_name: str):
        self.per_core = per_core  # (the core's index, its Stats)
        self.model_name = model_name

    def collect(self):
        families = []

        def family(kind, name, doc, value_of):
            f = kind(PREFIX + name, doc, labels=["model_name", "engine"])
            for index, stats in self.per_core:
                f.add_metric([self.model_name, str(index)], value_of(stats))
            families.append(f)

        family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full); cached blocks "
               "that no request holds count as free.",
               lambda s: (s.num_total_blocks - s.num_free_blocks) / s.num_total_blocks if s.num_total_blocks else 0.0)
        family(CounterMetricFamily, "num_preemptions", "Requests preempted (their blocks freed, recomputed later).",
               lambda s: s.num_preemptions)
        family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
               lambda s: s.num_prefix_cache_queried_tokens)
        family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
               lambda s: s.num_prefix_cache_hit_tokens)
        return families


def exposition(metrics: RequestMetrics, per_core: list[tuple[int, pb.Stats]] | None, model_name: str | None) -> bytes:
    """The text for one scrape: the request figures of every API server sharing the multiprocess
    folder (else this one's) and, when the cores answered and the served model is known, the
    cores' (under that model's name: there is no series without one), one series per core."""
    if metrics.model_name is not None:
        metrics.flush()
    scrape = CollectorRegistry()
    if multiprocess_dir():
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(scrape)
    else:
        scrape.register(_Forward(metrics.registry))
    if per_core and model_name is not None:
        scrape.register(CoreFigures(per_core, model_name))
    return generate_latest(scrape)


class _Forward:
    """A registry's families, as a collector of another registry."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        return self.registry.collect()
