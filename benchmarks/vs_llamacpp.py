"""llama.cpp's llama-server and `pagewire serve` on the CPU, side by side: the same weights, the
same prompts and the same client, one server at a time, in turn. Feeds docs/benchmarks.md,
section "7. Against llama.cpp's server on CPU".

    python benchmarks/vs_llamacpp.py [--configs llama:f32,pagewire:float32,llama:bf16,pagewire:bfloat16,llama:q8_0]
        [--repeat-runs 2] [--num-requests 64] [--concurrency 32] [--max-new-tokens 64] [--prompt-len 16]
        [--llama-server PATH] [--json PATH]

1. llama-server: the binary given by --llama-server, else one built from the llama.cpp that
   llama-cpp-python vendors (its source distribution, fetched with pip; cmake, CPU only,
   -march=native, Release), cached under $PAGEWIRE_CACHE_DIR/llama.cpp (~/.cache/pagewire) by
   version and CPU flags (``pagewire.bench.llamacpp``).
2. The weights: the embedded SmolLM2-135M-Instruct as pagewire converts it (dequantized to a
   safetensors directory), written as GGUF f32, bf16 and q8_0 by llama.cpp's own
   convert_hf_to_gguf.py, cached beside the binary: both servers run the same weights.
3. Each cycle (--repeat-runs of them) starts every configuration in turn, waits until it is
   ready, warms it up with one round of short requests, runs the workload with pagewire's bench
   client (streamed POST /v1/completions, greedy, ignore EOS, `max_tokens`), and stops it. Every
   request must come back with exactly --prompt-len prompt tokens and --max-new-tokens tokens, by
   the server's usage and by the chunks counted at the client, or the script stops.
4. A table on stdout, and --json with every run, the pooled figures, each server's command line
   and ``pagewire.bench.report.environment()`` (CPU model and ISA). Each run also reports how many
   cores' worth of CPU other processes took while it ran (from /proc): on a shared machine a run
   that lost CPU to others says so.

Needs cmake and a C/C++ compiler (unless --llama-server), PyPI for the first download, and the
converter's Python packages in this Python: torch, transformers, numpy, pyyaml, and sentencepiece
(not a pagewire dependency: ``pip install sentencepiece``). Linux.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from pagewire.bench.http_client import HttpClient
from pagewire.bench.llamacpp import (
    DEFAULT_CONFIGS,
    LLAMA_CPP_PYTHON_VERSION,
    LlamaCppError,
    ServerConfig,
    cache_dir,
    convert_to_gguf,
    find_or_build_server,
    parse_configs,
    server_command,
)
from pagewire.bench.loadgen import LoadResult, build_requests, run_rng, word_prompts
from pagewire.bench.metrics import RunMetrics, pooled_metrics, run_metrics
from pagewire.bench.procs import RunCpu, serve_roles
from pagewire.bench.report import cpu_info, environment, write_json
from pagewire.bench.server import BenchError, ServedServer, free_port
from pagewire.client import make_sampling
from pagewire_common import eventloop
from pagewire_common.settings import API, CORE, PROCESS, WORKER, Settings

HOST = "127.0.0.1"
WARMUP_TOKENS = 8
# warn when processes other than the client and the server took this many cores during a run
OTHERS_WARNING_CORES = 0.1
# llama-server sends no token ids; with this, every chunk carries its running count of generated
# tokens, which the client counts by (a chunk may hold no text, or the text of two tokens)
LLAMA_EXTRA_BODY = {"timings_per_token": True}


class LlamaServerProcess(ServedServer):
    """llama-server as a child process: ready once it says its model is loaded (the client then
    waits for /health to answer 200 as well)."""

    READY = "model loaded"


def _configs(text: str) -> list[ServerConfig]:
    try:
        return parse_configs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", type=_configs, default=DEFAULT_CONFIGS, metavar="ENGINE:TYPE[,...]",
                   help="servers to run in turn, in this order: llama:f32|f16|bf16|q8_0 (GGUF type) and "
                   "pagewire:DTYPE (its --dtype) (default: %(default)s)")
    p.add_argument("--repeat-runs", type=_positive, default=1, help="cycles through --configs (default: %(default)s)")
    p.add_argument("--num-requests", type=_positive, default=64, help="requests per run (default: %(default)s)")
    p.add_argument("--concurrency", type=_positive, default=32,
                   help="streams in flight, and llama-server's --parallel slots (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=_positive, default=64, help="tokens per request (default: %(default)s)")
    p.add_argument("--prompt-len", type=_positive, default=16, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="llama-server's --threads and --threads-batch (default: the cores this process may use; "
                   "pagewire's worker takes one thread per core by itself)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a built llama-server to use (default: build llama.cpp "
                   f"{LLAMA_CPP_PYTHON_VERSION!r} of llama-cpp-python once, cached)")
    p.add_argument("--llama-args", type=shlex.split, default=[], metavar="ARGS",
                   help="more options for llama-server, appended to its command line as one quoted string, e.g. "
                   "--llama-args='--no-repack' (default: none)")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for a server to be ready (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every run and the environment as JSON")
    args = p.parse_args(argv)
    if args.threads is None:
        args.threads = len(os.sched_getaffinity(0))
    return args


# ---- one server, one run ----------------------------------------------------------------------


def check_records(name: str, result: LoadResult, prompt_len: int, max_new_tokens: int) -> None:
    """Every request succeeded with the asked prompt and output lengths, and the client counted
    as many token arrivals as the server reports (so ITL and TTFT mean the same on both servers)."""
    for i, rec in enumerate(result.records):
        problem = None
        if not rec.ok:
            problem = f"failed: {rec.error}: {rec.error_message}"
        elif rec.prompt_tokens != prompt_len:
            problem = f"has {rec.prompt_tokens} prompt tokens, not {prompt_len} (the tokenizers differ?)"
        elif rec.completion_tokens != max_new_tokens:
            problem = f"returned {rec.completion_tokens} tokens, not {max_new_tokens}"
        elif rec.num_received_tokens != rec.completion_tokens:
            problem = (f"streamed {rec.num_received_tokens} tokens by the client's count, the server's usage says "
                       f"{rec.completion_tokens}")
        if problem:
            raise BenchError(f"{name}: request {i} {problem}")


async def measure(base_url: str, extra_body: dict, warmup, requests, concurrency: int, ready_timeout: float,
                  cpu: RunCpu) -> tuple[str, LoadResult, tuple[float, dict[str, float]]]:
    """Wait for the server, warm it up, run the workload; (served model name, the measured run, CPU
    seconds others took during it and CPU seconds by process)."""
    # a connection per request, for both servers: reusing kept-alive connections to llama-server
    # failed now and then (a request written on a connection the server had closed)
    client = HttpClient(base_url, extra_body, keep_alive=False)
    try:
        model = await client.wait_ready(ready_timeout)
        await client.run(warmup, model=model, concurrency=concurrency)
        cpu.start()
        result = await client.run(requests, model=model, concurrency=concurrency)
        return model, result, cpu.stop()
    finally:
        await client.close()


def start_server(config: ServerConfig, args, ggufs: dict[str, Path], binary: Path | None) -> tuple[ServedServer, str]:
    """The server of ``config``, started and printing that it is ready; (it, its HTTP base URL)."""
    port = free_port()
    if config.engine == "llama":
        # a slot stops one token short of its context
        slot = args.prompt_len + max(args.max_new_tokens, WARMUP_TOKENS) + 1
        argv = server_command(binary, ggufs[config.dtype], host=HOST, port=port, threads=args.threads,
                              parallel=args.concurrency, ctx_per_slot=slot) + args.llama_args
        server: ServedServer = LlamaServerProcess(argv, f"{HOST}:{port}")
    else:
        grpc_addr = f"{HOST}:{free_port()}"
        settings = Settings(dtype=config.dtype, http_listen=f"{HOST}:{port}")
        argv = [sys.executable, "-m", "pagewire.cli", "--log-level", "info", "serve", "--listen", grpc_addr,
                *settings.to_argv((WORKER, CORE, API, PROCESS))]
        server = ServedServer(argv, grpc_addr)
    try:
        server.start(args.ready_timeout)
    except BenchError as e:
        raise BenchError(f"{config.name}: {shlex.join(argv)}\n{e}") from None
    return server, f"http://{HOST}:{port}"


def run_config(config: ServerConfig, args, ggufs, binary, warmup, requests) -> dict:
    """Start the server, measure one run, stop it; the run's figures and how it ran."""
    load = os.getloadavg()
    server, base_url = start_server(config, args, ggufs, binary)
    try:
        extra_body = LLAMA_EXTRA_BODY if config.engine == "llama" else {}
        pid = server.proc.pid
        roles = {"llama-server": [pid]} if config.engine == "llama" else serve_roles(pid)
        model, result, (other_cpu, cpu) = eventloop.run(measure(base_url, extra_body, warmup, requests, args.concurrency,
                                                                args.ready_timeout, RunCpu(pid, roles)))
    finally:
        code = server.stop()
    if code not in (0, None, -15):
        print(f"{config.name}: the server exited with code {code}; its last output:\n{server.output_tail()}",
              file=sys.stderr)
    check_records(config.name, result, args.prompt_len, args.max_new_tokens)
    m = run_metrics(result.records, result.duration_s, client_cpu_fraction=result.client_cpu_fraction)
    others = other_cpu / result.duration_s  # cores' worth
    tokens = sum(r.completion_tokens for r in result.records)
    cpu_ms_per_token = {role: seconds * 1e3 / tokens for role, seconds in cpu.items()}
    print(f"{config.name}: {m.completion_tokens_per_s:,.1f} tok/s, TTFT p50 {m.ttft.p50 * 1e3:.0f} ms, "
          f"ITL p50/p99 {m.itl.p50 * 1e3:.1f}/{m.itl.p99 * 1e3:.1f} ms; load average before {load[0]:.2f}, "
          f"other processes used {others:.2f} cores during the run; CPU ms per token: "
          + ", ".join(f"{role} {ms:.2f}" for role, ms in cpu_ms_per_token.items()), file=sys.stderr, flush=True)
    if others > OTHERS_WARNING_CORES:
        print(f"{config.name}: warning: other processes took {others:.2f} cores during the run; its figures "
              f"measure a shared machine", file=sys.stderr)
    return {"config": config.name, "model": model, "command_line": shlex.join(server.argv),
            "load_average_before": list(load), "other_processes_cores": others, "cpu_ms_per_token": cpu_ms_per_token,
            "result": result, "metrics": m}


# ---- report -----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def summary_table(configs: list[ServerConfig], pooled: dict[str, RunMetrics], runs: dict[str, list[RunMetrics]],
                  others: dict[str, list[float]], isa: str) -> str:
    head = ["server", "ISA", "tok/s (each run)", "tok/s (pooled)", "TTFT p50 ms", "ITL p50 ms", "ITL p99 ms",
            "TPOT p50 ms", "client CPU", "others' cores"]
    rows = [head]
    for c in configs:
        m = pooled[c.name]
        rows.append([
            c.name, isa, ", ".join(f"{r.completion_tokens_per_s:.1f}" for r in runs[c.name]),
            f"{m.completion_tokens_per_s:.1f}", _ms(m.ttft.p50), _ms(m.itl.p50), _ms(m.itl.p99), _ms(m.tpot.p50),
            f"{m.client_cpu_fraction:.0%}" if m.client_cpu_fraction is not None else "n/a",
            ", ".join(f"{x:.2f}" for x in others[c.name]),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def cpu_table(configs: list[ServerConfig], done: list[dict]) -> str:
    """CPU ms per generated token of each process, the mean over a server's runs."""
    lines = ["\nCPU ms per generated token, by process (mean over runs):"]
    for c in configs:
        per_run = [d["cpu_ms_per_token"] for d in done if d["config"] == c.name]
        roles = {role: sum(r.get(role, 0.0) for r in per_run) / len(per_run) for role in per_run[0]}
        cells = ", ".join(f"{role} {ms:.2f}" for role, ms in roles.items())
        lines.append(f"  {c.name}: {cells}; all {sum(roles.values()):.2f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from scheduler_svc.api.tokenizer import Tokenizer
    from worker_svc.weights import resolve_model_path

    try:
        model_dir = resolve_model_path(None)  # the embedded model, converted to safetensors once
        root = cache_dir()
        llama_types = [c.dtype for c in args.configs if c.engine == "llama"]
        binary = None
        if llama_types:
            binary = Path(args.llama_server) if args.llama_server else find_or_build_server(root)
            if not binary.is_file():
                raise BenchError(f"--llama-server {binary}: no such file")
        ggufs = {t: convert_to_gguf(root, model_dir, t) for t in llama_types}
        tokenizer = Tokenizer(model_dir)
        sampling = make_sampling(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
        # text prompts: each server tokenizes them itself (the usage check below holds both to --prompt-len)
        try:
            texts = word_prompts(args.num_requests + args.concurrency, args.prompt_len, tokenizer,
                                 run_rng(args.seed, 0, "prompts"))
        except ValueError as e:
            raise BenchError(f"prompts: {e}") from None
        requests = build_requests(texts[:args.num_requests], sampling)
        warmup = build_requests(texts[args.num_requests:],
                                make_sampling(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
        isa = cpu_info()["cpu_isa"] or "unknown"
        print(f"{len(args.configs)} servers x {args.repeat_runs} cycle(s): {args.num_requests} requests, "
              f"{args.concurrency} streams, {args.prompt_len}-token prompts, {args.max_new_tokens} new tokens, greedy, "
              f"ignore EOS; {args.threads} llama-server threads; ISA {isa}", file=sys.stderr, flush=True)
        done: list[dict] = []
        for cycle in range(args.repeat_runs):
            for config in args.configs:
                print(f"cycle {cycle + 1}/{args.repeat_runs}: {config.name}...", file=sys.stderr, flush=True)
                done.append(run_config(config, args, ggufs, binary, warmup, requests) | {"cycle": cycle + 1})
    except (BenchError, LlamaCppError) as e:
        print(f"vs_llamacpp: error: {e}", file=sys.stderr)
        return 2
    runs = {c.name: [d["metrics"] for d in done if d["config"] == c.name] for c in args.configs}
    pooled = {c.name: pooled_metrics([(d["result"].records, d["result"].duration_s)
                                      for d in done if d["config"] == c.name],
                                     client_cpu_fractions=[m.client_cpu_fraction for m in runs[c.name]])
              for c in args.configs}
    others = {c.name: [d["other_processes_cores"] for d in done if d["config"] == c.name] for c in args.configs}
    sys.stdout.write(summary_table(args.configs, pooled, runs, others, isa))
    sys.stdout.write(cpu_table(args.configs, done))
    if args.json:
        doc = {
            "command_line": shlex.join([sys.executable, *sys.argv]),
            "environment": environment(),
            "workload": {"num_requests": args.num_requests, "concurrency": args.concurrency,
                         "prompt_len": args.prompt_len, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                         "temperature": 0.0, "ignore_eos": True, "warmup": f"{args.concurrency} requests x "
                         f"{WARMUP_TOKENS} tokens per server start", "repeat_runs": args.repeat_runs},
            "llama_cpp": {"llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION, "binary": str(binary) if binary else None,
                          "threads": args.threads, "gguf": {t: str(p) for t, p in ggufs.items()}},
            "model_dir": str(model_dir),
            "order": [d["config"] for d in done],
            "configs": {c.name: {"engine": c.engine, "dtype": c.dtype,
                                 "runs": [{"cycle": d["cycle"], "command_line": d["command_line"], "model": d["model"],
                                           "load_average_before": d["load_average_before"],
                                           "other_processes_cores": d["other_processes_cores"],
                                           "cpu_ms_per_token": d["cpu_ms_per_token"],
                                           **d["metrics"].to_dict()} for d in done if d["config"] == c.name],
                                 "aggregate": pooled[c.name].to_dict()} for c in args.configs},
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
