"""Benchmark metrics, measured at the client, as pure functions of per-request timestamps.

Definitions (all times from ``time.perf_counter``, in seconds):

- **TTFT** (time to first token): from sending the request to the arrival of the first response
  that carries a token.
- **TPOT** (time per output token): ``(t_last - t_first) / (n - 1)`` for a request that received
  ``n >= 2`` tokens, where ``t_first``/``t_last`` are the arrival times of its first and last token.
  Requests with fewer than two tokens have no TPOT.
- **ITL** (inter-token latency): every gap between token arrivals, pooled across requests. A
  response carrying ``k > 1`` tokens (the server packs tokens that queued up into one message)
  counts as one arrival followed by ``k - 1`` zero gaps: its first token arrives after the gap
  since the previous response, the others at the same instant. A request with ``n`` tokens thus
  contributes exactly ``n - 1`` gaps whose sum is ``t_last - t_first``, so the mean of a request's
  gaps is its TPOT and no token is left out. (The alternative, ignoring packing, would hide the
  time the tokens waited and overstate the gaps.)
- **E2E latency**: from sending the request to the arrival of its last response.
- **Throughput** over a run's wall time (first send to last response): completion tokens/s, total
  (prompt + completion) tokens/s and requests/s, counting successful requests only.

Percentiles interpolate linearly between the closest ranks (numpy's default ``"linear"``
method): for ``n`` sorted values ``v``, percentile ``q`` is at rank ``r = q / 100 * (n - 1)``, i.e.
``v[floor(r)] + (v[ceil(r)] - v[floor(r)]) * (r - floor(r))``.

Pure Python (no numpy, no torch), so the arithmetic is easy to test exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 95, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: Sequence[float], q: float, *, is_sorted: bool = False) -> float:
    """The ``q``-th percentile (0 <= q <= 100) of ``values`` by linear interpolation between the
    closest ranks (numpy's default). Raises ``ValueError`` for no values or ``q`` out of range."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        raise ValueError("percentile of no values")
    v = values if is_sorted else sorted(values)
    rank = q / 100 * (len(v) - 1)
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return v[lo] + (v[hi] - v[lo]) * (rank - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    """Distribution of one latency metric over a run (seconds)."""

    count: int
    mean: float
    p50: float
    p95: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Summary | None:
        """The summary of ``values``; None when there are none (the metric is not available)."""
        v = sorted(values)
        if not v:
            return None
        return cls(
            count=len(v),
            mean=math.fsum(v) / len(v),
            p50=percentile(v, 50, is_sorted=True),
            p95=percentile(v, 95, is_sorted=True),
            p99=percentile(v, 99, is_sorted=True),
            min=v[0],
            max=v[-1],
        )

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request.

    ``arrival_times[i]`` is when response ``i`` arrived and ``arrival_counts[i]`` how many tokens
    it carried (0 is allowed: such a response is not a token arrival). A request measured only as
    a whole (a static batch) has no arrivals, only ``send_time``/``end_time`` and token counts.
    ``error`` is the status name of a failed request (its timings are not used).
    """

    send_time: float = 0.0
    end_time: float = 0.0
    arrival_times: list[float] = field(default_factory=list)
    arrival_counts: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    error: str | None = None
    error_message: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def num_received_tokens(self) -> int:
        return sum(self.arrival_counts)


def ttft(rec: RequestRecord) -> float | None:
    """Send -> first token; None when no response carried a token."""
    for t, k in zip(rec.arrival_times, rec.arrival_counts):
        if k > 0:
            return t - rec.send_time
    return None


def _token_arrivals(rec: RequestRecord) -> list[tuple[float, int]]:
    return [(t, k) for t, k in zip(rec.arrival_times, rec.arrival_counts) if k > 0]


def tpot(rec: RequestRecord) -> float | None:
    """(last token - first token) / (n - 1); None for fewer than two tokens."""
    arrivals = _token_arrivals(rec)
    n = sum(k for _, k in arrivals)
    if n < 2:
        return None
    return (arrivals[-1][0] - arrivals[0][0]) / (n - 1)


def inter_token_latencies(rec: RequestRecord) -> list[float]:
    """The ``n - 1`` gaps between the ``n`` tokens of one request (see the module docstring:
    ``k`` tokens in one response are one arrival followed by ``k - 1`` zero gaps)."""
    gaps: list[float] = []
    prev: float | None = None
    for t, k in _token_arrivals(rec):
        if prev is not None:
            gaps.append(t - prev)
        gaps.extend([0.0] * (k - 1))
        prev = t
    return gaps


def e2e_latency(rec: RequestRecord) -> float:
    return rec.end_time - rec.send_time


@dataclass(slots=True)
class RunMetrics:
    """The figures of one run (or of several runs pooled). A latency summary is None when the
    metric is not measurable for this engine (e.g. per-token times of a static batch)."""

    num_requests: int
    num_failed: int
    duration_s: float
    prompt_tokens: int
    completion_tokens: int
    completion_tokens_per_s: float
    total_tokens_per_s: float
    requests_per_s: float
    ttft: Summary | None
    tpot: Summary | None
    itl: Summary | None
    e2e: Summary | None
    errors: dict[str, int] = field(default_factory=dict)
    cached_prompt_tokens: int = 0
    # CPU time of the busiest load-generator process / wall time (None where not measured): near
    # 1.0 the client, not the server, may be what limits the run
    client_cpu_fraction: float | None = None

    def latency(self, name: str) -> Summary | None:
        return getattr(self, name)

    def to_dict(self) -> dict:
        out = {
            "num_requests": self.num_requests,
            "num_failed": self.num_failed,
            "errors": dict(self.errors),
            "duration_s": self.duration_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "completion_tokens_per_s": self.completion_tokens_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "client_cpu_fraction": self.client_cpu_fraction,
        }
        for name in LATENCY_METRICS:
            s = self.latency(name)
            out[f"{name}_s"] = s.to_dict() if s is not None else None
        return out


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def run_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    per_token: bool = True,
    client_cpu_fraction: float | None = None,
) -> RunMetrics:
    """Summarise one run of ``records`` that took ``duration_s`` of wall time. With
    ``per_token=False`` (requests measured only as a whole) TTFT, TPOT and ITL are None."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    if per_token:
        for r in ok:
            t = ttft(r)
            if t is not None:
                ttfts.append(t)
            t = tpot(r)
            if t is not None:
                tpots.append(t)
            itls.extend(inter_token_latencies(r))
    return RunMetrics(
        num_requests=len(records),
        num_failed=len(records) - len(ok),
        duration_s=duration_s,
        prompt_tokens=prompt,
        completion_tokens=completion,
        completion_tokens_per_s=_rate(completion, duration_s),
        total_tokens_per_s=_rate(prompt + completion, duration_s),
        requests_per_s=_rate(len(ok), duration_s),
        ttft=Summary.of(ttfts),
        tpot=Summary.of(tpots),
        itl=Summary.of(itls),
        e2e=Summary.of(e2e_latency(r) for r in ok),
        errors=errors,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in ok),
        client_cpu_fraction=client_cpu_fraction,
    )


def pooled_metrics(
    runs: Sequence[tuple[Sequence[RequestRecord], float]],
    *,
    per_token: bool = True,
    client_cpu_fractions: Sequence[float | None] = (),
) -> RunMetrics:
    """The aggregate of several runs: latency distributions over all their requests pooled,
    throughput as all tokens over the summed wall times, the busiest client CPU use of any run."""
    records = [r for recs, _ in runs for r in recs]
    measured = [f for f in client_cpu_fractions if f is not None]
    return run_metrics(
        records, sum(d for _, d in runs), per_token=per_token, client_cpu_fraction=max(measured) if measured else None
    )


def ratio(ours: float | None, baseline: float | None, *, higher_is_better: bool) -> float | None:
    """How many times better ours is: ``ours / baseline`` for a throughput (higher is better),
    ``baseline / ours`` for a latency (lower is better). > 1 means ours is better. None when
    either side is missing or the divisor is zero."""
    if ours is None or baseline is None:
        return None
    num, den = (ours, baseline) if higher_is_better else (baseline, ours)
    if den == 0:
        return None
    return num / den


@dataclass(frozen=True, slots=True)
class Figure:
    """One comparable figure of a run: a label, how to read it from ``RunMetrics``, and which
    direction is better."""

    key: str  # stable id used in JSON, e.g. "completion_tokens_per_s", "ttft_p50"
    label: str
    unit: str  # "tok/s", "req/s" or "ms"
    higher_is_better: bool

    def value(self, m: RunMetrics) -> float | None:
        if self.higher_is_better:
            return getattr(m, self.key)
        name, stat = self.key.rsplit("_", 1)
        s = m.latency(name)
        return None if s is None else getattr(s, stat)


FIGURES: tuple[Figure, ...] = (
    Figure("completion_tokens_per_s", "output throughput", "tok/s", True),
    Figure("total_tokens_per_s", "total throughput", "tok/s", True),
    Figure("requests_per_s", "request throughput", "req/s", True),
    *(
        Figure(f"{name}_{stat}", f"{label} {stat}", "ms", False)
        for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))
        for stat in ("mean", "p50", "p95", "p99")
    ),
)


def compare(ours: RunMetrics, baseline: RunMetrics) -> dict[str, float | None]:
    """Figure key -> ratio (> 1 means ours is better) for every figure in :data:`FIGURES`."""
    return {
        f.key: ratio(f.value(ours), f.value(baseline), higher_is_better=f.higher_is_better) for f in FIGURES
    }
