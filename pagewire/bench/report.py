"""Presenting bench results: the plain-text summary, the JSON document and the latency plot.

The JSON document (``--json``), schema version 1::

    schema_version  1
    command_line    the exact command line (shell-quoted); argv: the same as a list
    environment     python, platform, cpu_count, cpu_cores_usable, cpu_model, cpu_isa (the best of ISA_LEVELS the
                    CPU has, e.g. avx512_bf16 or avx2; null if unknown), cpu_isa_flags (all of ISA_LEVELS it has),
                    cpu_isa_capped_from (the CPU's own best where PAGEWIRE_CPU_ISA capped it, else null), pagewire, torch, transformers, grpcio, cuda, gpu (name or null)
    config          the workload (num_requests, concurrency | request_rate, seed, prompt_len [lo, hi] | prompt +
                    prompt_repeats, max_new_tokens, ignore_eos, temperature, warmup_runs, repeat_runs, ...),
                    baselines, client_processes, worker, and engine: the options of the server the bench
                    started (--serve; null for a server it did not start, which ``server`` describes)
    server          addr, started_by_bench, model_info (model_name, max_model_len, vocab_size, block_size,
                    num_kv_blocks, dtype, device, eos_token_ids)
    server_cpu      the served server's CPU (user + system, from /proc) during each measured run, by role: with --serve
                    {"known": true, "pids": {role: [pid, ...]}, "engines": {ours: {runs: [{role: CPU}, ...],
                    aggregate: {role: CPU}}}} for each of our columns (pagewire, pagewire-openai, ...); roles "serve",
                    "worker" (rank 0), "worker rank R", "core", "api-server N", "api-server N helpers" (its tokenizer
                    helper and multiprocessing's resource tracker); CPU = {cpu_s, us_per_token (cpu_s per completion
                    token the client received, in µs; null over none), busy_fraction (cpu_s / the run's wall time:
                    1.0 = one core busy all along)}. Without --serve {"known": false, "reason": ...}: the bench does
                    not know the processes of a server it did not start.
    prefix_cache    the server's prefix-cache counters (GetStats, over gRPC whatever the --backend) over each
                    measured run: {"ideal_hit_rate": fraction of the prompt tokens in full KV blocks of a prefix an
                    earlier request of the run sent (--prefix-groups; else null), "engines": {ours: {"known": true,
                    runs: [COUNTS, ...], aggregate: COUNTS} | {"known": false, "reason": ...}}} for each of our
                    columns; COUNTS = {queried_tokens, hit_tokens, hit_rate (hit / queried; null when nothing was
                    looked up: prefix cache off)}. Counters are server-wide: other clients' requests count too.
    engines         {"pagewire" | "pagewire-openai" | "hf" | "hf-cb": {per_token_timings, details, runs: [RUN, ...], aggregate: RUN}}
    comparison      {baseline: {figure key: ratio or null}}; > 1 means pagewire is better (figure keys:
                    completion_tokens_per_s, total_tokens_per_s, requests_per_s, {ttft,tpot,itl,e2e}_{mean,p50,p95,p99})

    RUN = {num_requests, num_failed, errors {status: count}, duration_s, prompt_tokens, cached_prompt_tokens,
           completion_tokens, completion_tokens_per_s, total_tokens_per_s, requests_per_s, client_cpu_fraction,
           ttft_s, tpot_s, itl_s, e2e_s}
    each *_s latency is {count, mean, p50, p95, p99, min, max} in seconds, or null where not measurable.
    ``aggregate`` pools the measured runs (latencies over all requests, throughput over summed wall time).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pagewire.bench.metrics import (
    FIGURES,
    RequestRecord,
    RunMetrics,
    compare,
    e2e_latency,
    inter_token_latencies,
    ttft,
)
from pagewire.bench.prefix_cache import prefix_cache_lines
from worker_svc.cpu import features

JSON_SCHEMA_VERSION = 1
OURS = "pagewire"


@dataclass(slots=True)
class EngineResult:
    """All runs of one engine (ours or a baseline)."""

    name: str
    runs: list[RunMetrics]
    aggregate: RunMetrics
    records: list[RequestRecord]  # the measured runs' requests, pooled (for plots)
    per_token: bool = True  # False: only whole-request timings (static batches)
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "per_token_timings": self.per_token,
            "details": self.details,
            "runs": [r.to_dict() for r in self.runs],
            "aggregate": self.aggregate.to_dict(),
        }


# ---- text ------------------------------------------------------------------------------------


def _fmt_value(value: float | None, unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "ms":
        return f"{value * 1e3:.2f}"
    if unit == "req/s":
        return f"{value:,.2f}"
    return f"{value:,.1f}"


def _fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _table(rows: list[list[str]], align_left_cols: int = 1) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, row in enumerate(rows):
        cells = [c.ljust(w) if i < align_left_cols else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_text(results: list[EngineResult], header: list[str], server_cpu: dict | None = None,
                 prefix_cache: dict | None = None) -> str:
    """The summary table: one column per engine, and after each baseline the ratio of ours to it
    (ours / baseline for throughput, baseline / ours for latency: > 1 means ours is better); the
    server's prefix-cache hit rate (the JSON's ``prefix_cache``) and the served server's CPU by role
    (the JSON's ``server_cpu``), where given."""
    ours = next(r for r in results if r.name == OURS)
    baselines = [r for r in results if r.name != OURS]
    head = ["metric", OURS]
    for b in baselines:
        head += [b.name, f"vs {b.name}"]
    rows = [head]

    def counts_row(label: str, get) -> list[str]:
        row = [label, get(ours.aggregate)]
        for b in baselines:
            row += [get(b.aggregate), ""]
        return row

    rows.append(counts_row("requests (failed)", lambda m: f"{m.num_requests} ({m.num_failed})"))
    rows.append(counts_row("prompt tokens", lambda m: f"{m.prompt_tokens:,}"))
    rows.append(counts_row("completion tokens", lambda m: f"{m.completion_tokens:,}"))
    rows.append(counts_row("wall time (s)", lambda m: f"{m.duration_s:.3f}"))
    rows.append(counts_row("client CPU (busiest process)", lambda m: "n/a" if m.client_cpu_fraction is None
                           else f"{m.client_cpu_fraction:.0%}"))
    ratios = {b.name: compare(ours.aggregate, b.aggregate) for b in baselines}
    for f in FIGURES:
        row = [f"{f.label} ({f.unit})", _fmt_value(f.value(ours.aggregate), f.unit)]
        for b in baselines:
            row += [_fmt_value(f.value(b.aggregate), f.unit), _fmt_ratio(ratios[b.name][f.key])]
        rows.append(row)
    out = list(header) + ["", _table(rows)]
    if prefix_cache is not None:
        out += ["", *prefix_cache_lines(prefix_cache)]
    if baselines:
        out += [
            "",
            "vs X: how many times better pagewire is (throughput: pagewire / X; latency: X / pagewire).",
        ]
        if any(not b.per_token for b in baselines):
            out.append("hf (static batches): per-token timings are not observable; E2E latency is the batch's.")
        if any(b.name == "hf-cb" for b in baselines):
            out.append("hf-cb: token times are stamped in its generation thread (no transport), pagewire's at a gRPC client.")
    if len(ours.runs) > 1 or any(len(b.runs) > 1 for b in baselines):
        out += ["", "per run:"]
        run_rows = [["engine", "run", "wall (s)", "output tok/s", "total tok/s", "TTFT p50 (ms)", "ITL p50 (ms)", "failed"]]
        for r in results:
            for i, m in enumerate(r.runs):
                run_rows.append([
                    r.name, str(i + 1), f"{m.duration_s:.3f}", f"{m.completion_tokens_per_s:,.1f}",
                    f"{m.total_tokens_per_s:,.1f}", _fmt_value(m.ttft.p50 if m.ttft else None, "ms"),
                    _fmt_value(m.itl.p50 if m.itl else None, "ms"), str(m.num_failed),
                ])
        out.append(_table(run_rows, align_left_cols=1))
    errors = {r.name: r.aggregate.errors for r in results if r.aggregate.errors}
    if errors:
        out += ["", "failed requests by status: " + "; ".join(f"{k}: {v}" for k, v in errors.items())]
    if server_cpu is not None:
        out += ["", *server_cpu_lines(server_cpu)]
    return "\n".join(out) + "\n"


def server_cpu_lines(server_cpu: dict) -> list[str]:
    """One line per column of ours: each role's CPU µs per output token and share of a core (a
    role near 100% of a core while the GPU waits is what holds the run back)."""
    if not server_cpu["known"]:
        return [f"server CPU: not known ({server_cpu['reason']})"]
    lines = []
    for name, cpu in server_cpu["engines"].items():
        cells = ", ".join(f"{role} {_fmt_value(c['us_per_token'], 'us')} ({c['busy_fraction']:.0%})"
                          for role, c in cpu["aggregate"].items())
        lines.append(f"server CPU us per output token (share of a core), {name}: {cells}")
    return lines


# ---- JSON ------------------------------------------------------------------------------------


def cpu_info(cpuinfo: str | None = None) -> dict:
    """This machine's CPU: ``cpu_model`` ("model name"; None where /proc/cpuinfo has none, as on
    Arm), ``cpu_isa`` (the best of ``ISA_LEVELS`` it has, or None: the same command gives very
    different figures on an avx512_bf16 host and an avx2-only one), ``cpu_isa_flags`` (every one of
    ``ISA_LEVELS`` it has, best first), ``cpu_isa_capped_from`` (the CPU's own best ISA where
    ``PAGEWIRE_CPU_ISA`` capped it, else None), ``cpu_cores_usable`` (cores this process may run on).
    ``cpuinfo``: the text of /proc/cpuinfo, read here when None (empty where there is none)."""
    cpu = features.cpu_info() if cpuinfo is None else features.parse_cpuinfo(cpuinfo)
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": cpu.model,
        "cpu_isa": cpu.isa,
        "cpu_isa_flags": cpu.isa_flags,
        "cpu_isa_capped_from": cpu.capped_from,
        "cpu_cores_usable": usable,
    }


def isa_text(cpu: dict) -> str:
    """``cpu_info()``'s ISA as summaries print it (``features.describe_isa``)."""
    return features.describe_isa(cpu["cpu_isa"], cpu.get("cpu_isa_capped_from"))


def environment() -> dict:
    """Versions and hardware of this machine, the CPU's ISA included (imports torch: call after
    measuring)."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        **cpu_info(),
        "pagewire": version("pagewire"),
        "torch": None,
        "transformers": version("transformers"),
        "grpcio": version("grpcio"),
        "cuda": None,
        "gpu": None,
    }
    try:
        import torch

        env["torch"] = torch.__version__
        if torch.cuda.is_available():
            env["cuda"] = torch.version.cuda
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return env


def json_document(
    results: list[EngineResult], *, argv: list[str], command_line: str, config: dict, server: dict,
    server_cpu: dict, env: dict, prefix_cache: dict | None = None,
) -> dict:
    ours = next(r for r in results if r.name == OURS)
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "command_line": command_line,
        "argv": argv,
        "environment": env,
        "config": config,
        "server": server,
        "server_cpu": server_cpu,
        "prefix_cache": prefix_cache,
        "engines": {r.name: r.to_dict() for r in results},
        "comparison": {r.name: compare(ours.aggregate, r.aggregate) for r in results if r.name != OURS},
    }


def write_json(path: str | Path, document: dict) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=2, allow_nan=False, default=_json_default) + "\n")
    os.replace(tmp, path)


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


# ---- plot ------------------------------------------------------------------------------------


def require_matplotlib():
    """Import matplotlib (Agg backend) or raise ImportError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'pagewire[bench]' (or pip install matplotlib)"
        ) from None
    return plt


def write_plot(path: str | Path, results: list[EngineResult], title: str) -> None:
    """TTFT, ITL and E2E latency distributions (histogram and CDF) of every engine that measured them."""
    plt = require_matplotlib()
    series = {
        "TTFT": {r.name: [x * 1e3 for x in (ttft(q) for q in r.records if q.ok) if x is not None]
                 for r in results if r.per_token},
        "ITL": {r.name: [g * 1e3 for q in r.records if q.ok for g in inter_token_latencies(q)]
                for r in results if r.per_token},
        "E2E latency": {r.name: [e2e_latency(q) * 1e3 for q in r.records if q.ok] for r in results},
    }
    colors = {r.name: f"C{i}" for i, r in enumerate(results)}  # one colour per engine in every panel
    fig, axes = plt.subplots(len(series), 2, figsize=(12, 4 * len(series)), squeeze=False)
    for row, (metric, by_engine) in enumerate(series.items()):
        ax_hist, ax_cdf = axes[row]
        everything = [x for values in by_engine.values() for x in values]
        if everything:
            # shared bins so the engines' bars compare
            lo, hi = min(everything), max(everything)
            num_bins = min(60, max(10, int(len(everything) ** 0.5)))
            width = (hi - lo) / num_bins or 1e-3
            bins = [lo + width * i for i in range(num_bins + 1)]
        for name, values in by_engine.items():
            if not values:
                continue
            ax_hist.hist(values, bins=bins, alpha=0.5, color=colors[name], label=f"{name} (n={len(values)})")
            v = sorted(values)
            ax_cdf.plot(v, [(i + 1) / len(v) for i in range(len(v))], color=colors[name], label=name)
        ax_hist.set_title(f"{metric}: histogram")
        ax_hist.set_xlabel("ms")
        ax_hist.set_ylabel("count")
        ax_cdf.set_title(f"{metric}: CDF")
        ax_cdf.set_xlabel("ms")
        ax_cdf.set_ylabel("fraction of samples")
        ax_cdf.grid(True, alpha=0.3)
        for ax in (ax_hist, ax_cdf):
            if ax.has_data():
                ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
