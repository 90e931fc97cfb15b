"""llama.cpp's llama-server and `pagewire serve` on the CPU, side by side: the same weights, the
same prompts and the same client, one server at a time, in turn, in two scenarios (one user alone,
many at once). Feeds docs/benchmarks.md, section "7. Against llama.cpp's server on CPU".

    python benchmarks/vs_llamacpp.py [--configs llama:q4_1,pagewire:auto,llama:q8_0,llama:bf16]
        [--scenarios one-stream,32-streams] [--repeat-runs 2] [--prompt-len 16]
        [--llama-server PATH] [--json PATH]

1. llama-server: the binary given by --llama-server, else one built from the llama.cpp that
   llama-cpp-python vendors (its source distribution, fetched with pip; cmake, CPU only,
   -march=native, Release), cached under $PAGEWIRE_CACHE_DIR/llama.cpp (~/.cache/pagewire) by
   version and CPU flags (``pagewire.bench.llamacpp``).
2. The weights: the embedded SmolLM2-135M-Instruct GGUF (Q4_1) as it ships (``llama:q4_1``), and
   as pagewire converts it (dequantized to a safetensors directory) written as GGUF f32, f16, bf16
   or q8_0 by llama.cpp's own convert_hf_to_gguf.py, cached beside the binary: both servers run
   the same weights.
3. The servers (--configs): ``ENGINE:TYPE`` and, after a space, more flags for that server
   (``llama:q8_0 --no-repack``, ``pagewire:auto --no-prefix-cache``; pagewire's are checked by
   its own parser first). A llama-server killed by SIGILL (its repacked kernels use an instruction
   the CPU lacks, as on some VMs) is run again with --no-repack, which the output and the JSON say.
4. The scenarios (--scenarios): ``one-stream`` (one client, 8 prompts one after another, 128 new
   tokens each, llama-server with one slot) and ``32-streams`` (64 requests over 32 streams, 64
   new tokens each, 32 slots), or ``CxRxT``. Each cycle (--repeat-runs of them) runs every scenario,
   and in it starts every configuration in turn, waits until it is ready, warms it up with one
   round of short requests, runs the workload with pagewire's bench client (streamed POST
   /v1/completions, greedy, ignore EOS, `max_tokens`), and stops it. Every request must come back
   with exactly --prompt-len prompt tokens and the scenario's new tokens, by the server's usage and
   by the chunks counted at the client, or the script stops.
5. A table per scenario on stdout: completion tok/s (all streams, first token included), the
   decode rate after the first token (a lone stream's speed), latencies, and how many cores' worth
   of CPU other processes took while it ran (from /proc: on a shared machine a run that lost CPU
   to others says so); then each pagewire configuration against llama-server's best type. --json
   has every run, the pooled figures, each server's command line and
   ``pagewire.bench.report.environment()`` (CPU model and ISA).

Needs cmake and a C/C++ compiler (unless --llama-server), PyPI for the first download, and the
converter's Python packages in this Python: torch, transformers, numpy, pyyaml, and sentencepiece
(not a pagewire dependency: ``pip install sentencepiece``). Linux.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from pagewire.bench.http_client import HttpClient
from pagewire.bench.llamacpp import (
    DEFAULT_CONFIGS,
    DEFAULT_SCENARIOS,
    EMBEDDED_GGUF_TYPE,
    LLAMA_CPP_PYTHON_VERSION,
    LlamaCppError,
    Scenario,
    ServerConfig,
    cache_dir,
    convert_to_gguf,
    decode_tokens_per_s,
    find_or_build_server,
    pagewire_serve_argv,
    parse_configs,
    parse_scenarios,
    server_command,
)
from pagewire.bench.loadgen import LoadResult, build_requests, run_rng, word_prompts
from pagewire.bench.metrics import RunMetrics, pooled_metrics, run_metrics
from pagewire.bench.procs import RunCpu, serve_roles
from pagewire.bench.report import cpu_info, environment, isa_text, write_json
from pagewire.bench.server import BenchError, ServedServer, free_port
from pagewire.client import make_sampling
from pagewire_common import eventloop

HOST = "127.0.0.1"
WARMUP_TOKENS = 8
# warn when processes other than the client and the server took this many cores during a run
OTHERS_WARNING_CORES = 0.1
# llama-server sends no token ids; with this, every chunk carries its running count of generated
# tokens, which the client counts by (a chunk may hold no text, or the text of two tokens)
LLAMA_EXTRA_BODY = {"timings_per_token": True}
NO_REPACK = "--no-repack"


class LlamaServerProcess(ServedServer):
    """llama-server as a child process: ready once it says its model is loaded (the client then
    waits for /health to answer 200 as well)."""

    READY = "model loaded"


class IllegalInstruction(BenchError):
    """llama-server died of SIGILL: its repacked kernels use an instruction this CPU (or VM) lacks."""


def _configs(text: str) -> list[ServerConfig]:
    try:
        return parse_configs(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _scenarios(text: str) -> list[Scenario]:
    try:
        return parse_scenarios(text)
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
    p.add_argument("--configs", type=_configs, default=DEFAULT_CONFIGS, metavar="ENGINE:TYPE[ FLAGS][,...]",
                   help="servers to run in turn, in this order: llama:f32|f16|bf16|q8_0 (converted GGUF) or llama:q4_1 "
                   "(the embedded GGUF as it ships), pagewire:DTYPE (its --dtype); after a space, more flags for that "
                   "server, e.g. 'llama:q8_0 --no-repack', 'pagewire:auto --no-prefix-cache' (default: %(default)s)")
    p.add_argument("--scenarios", type=_scenarios, default=DEFAULT_SCENARIOS, metavar="NAME|CxRxT[,...]",
                   help="workloads, each over every server: one-stream (1 stream, 8 requests, 128 new tokens), "
                   "32-streams (32 streams, 64 requests, 64 new tokens), or C streams x R requests x T new tokens "
                   "(default: %(default)s)")
    p.add_argument("--repeat-runs", type=_positive, default=1,
                   help="cycles through --scenarios and --configs (default: %(default)s)")
    p.add_argument("--prompt-len", type=_positive, default=16, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="llama-server's --threads and --threads-batch (default: the cores this process may use; "
                   "pagewire's worker takes one thread per core by itself)")
    p.add_argument("--llama-server", default=None, metavar="PATH",
                   help="a built llama-server to use (default: build llama.cpp "
                   f"{LLAMA_CPP_PYTHON_VERSION!r} of llama-cpp-python once, cached)")
    p.add_argument("--llama-args", type=shlex.split, default=[], metavar="ARGS",
                   help="more options for every llama-server, appended to its command line as one quoted string "
                   "(one configuration's own: after its type in --configs) (default: none)")
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


def server_argv(config: ServerConfig, scenario: Scenario, args, ggufs: dict[str, Path], binary: Path | None,
                port: int, grpc_port: int) -> list[str]:
    """The command line of ``config``'s server for ``scenario``, its HTTP door on ``port``."""
    if config.engine == "llama":
        # a slot stops one token short of its context
        slot = args.prompt_len + max(scenario.max_new_tokens, WARMUP_TOKENS) + 1
        return server_command(binary, ggufs[config.dtype], host=HOST, port=port, threads=args.threads,
                              parallel=scenario.concurrency, ctx_per_slot=slot) + args.llama_args + list(config.args)
    return [sys.executable, "-m", "pagewire.cli", "--log-level", "info", "serve", "--listen", f"{HOST}:{grpc_port}",
            *pagewire_serve_argv(config.args, dtype=config.dtype, http_listen=f"{HOST}:{port}")]


def start_server(config: ServerConfig, scenario: Scenario, args, ggufs, binary) -> tuple[ServedServer, str]:
    """The server of ``config``, started and printing that it is ready; (it, its HTTP base URL)."""
    port, grpc_port = free_port(), free_port()
    argv = server_argv(config, scenario, args, ggufs, binary, port, grpc_port)
    server = LlamaServerProcess(argv, f"{HOST}:{port}") if config.engine == "llama" else \
        ServedServer(argv, f"{HOST}:{grpc_port}")
    try:
        server.start(args.ready_timeout)
    except BenchError as e:
        if config.engine == "llama" and server.proc is not None and server.proc.returncode == -signal.SIGILL:
            raise IllegalInstruction(f"{config.name}: llama-server died of SIGILL while loading") from None
        raise BenchError(f"{config.name}: {shlex.join(argv)}\n{e}") from None
    return server, f"http://{HOST}:{port}"


def run_config(config: ServerConfig, scenario: Scenario, args, ggufs, binary, warmup, requests) -> dict:
    """Start the server, measure one run, stop it; the run's figures and how it ran."""
    load = os.getloadavg()
    server, base_url = start_server(config, scenario, args, ggufs, binary)
    code = None
    try:
        extra_body = LLAMA_EXTRA_BODY if config.engine == "llama" else {}
        pid = server.proc.pid
        roles = {"llama-server": [pid]} if config.engine == "llama" else serve_roles(pid)
        model, result, (other_cpu, cpu) = eventloop.run(measure(base_url, extra_body, warmup, requests,
                                                                scenario.concurrency, args.ready_timeout,
                                                                RunCpu(pid, roles)))
    except BaseException:
        code = server.stop()
        if config.engine == "llama" and code == -signal.SIGILL:
            raise IllegalInstruction(f"{config.name}: llama-server died of SIGILL during the run") from None
        raise
    finally:
        if code is None:
            code = server.stop()
    if code not in (0, None, -15):
        print(f"{config.name}: the server exited with code {code}; its last output:\n{server.output_tail()}",
              file=sys.stderr)
    if config.engine == "llama" and code == -signal.SIGILL:
        raise IllegalInstruction(f"{config.name}: llama-server died of SIGILL")
    check_records(config.name, result, args.prompt_len, scenario.max_new_tokens)
    m = run_metrics(result.records, result.duration_s, client_cpu_fraction=result.client_cpu_fraction)
    decode = decode_tokens_per_s(result.records)
    others = other_cpu / result.duration_s  # cores' worth
    tokens = sum(r.completion_tokens for r in result.records)
    cpu_ms_per_token = {role: seconds * 1e3 / tokens for role, seconds in cpu.items()}
    print(f"{scenario.name} {config.name}: {m.completion_tokens_per_s:,.1f} tok/s, decode {_rate(decode)} tok/s after "
          f"the first token, TTFT p50 {m.ttft.p50 * 1e3:.0f} ms, ITL p50/p99 {m.itl.p50 * 1e3:.1f}/"
          f"{m.itl.p99 * 1e3:.1f} ms; load average before {load[0]:.2f}, other processes used {others:.2f} cores "
          "during the run; CPU ms per token: " + ", ".join(f"{role} {ms:.2f}" for role, ms in cpu_ms_per_token.items()),
          file=sys.stderr, flush=True)
    if others > OTHERS_WARNING_CORES:
        print(f"{config.name}: warning: other processes took {others:.2f} cores during the run; its figures "
              f"measure a shared machine", file=sys.stderr)
    return {"config": config.name, "model": model, "command_line": shlex.join(server.argv),
            "load_average_before": list(load), "other_processes_cores": others, "cpu_ms_per_token": cpu_ms_per_token,
            "decode_tokens_per_s": decode, "result": result, "metrics": m}


# ---- report -----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1e3:.1f}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def headline(scenario: Scenario, run: dict) -> float | None:
    """The figure a scenario is judged by: a lone stream's decode rate, else completion tok/s."""
    return run["decode_tokens_per_s"] if scenario.concurrency == 1 else run["metrics"].completion_tokens_per_s


def summary_table(names: list[str], done: list[dict], pooled: dict[str, RunMetrics], isa: str) -> str:
    head = ["server", "ISA", "tok/s (each run)", "decode tok/s (each run)", "decode (pooled)", "TTFT p50 ms",
            "ITL p50 ms", "ITL p99 ms", "client CPU", "others' cores"]
    rows = [head]
    for name in names:
        runs = [d for d in done if d["config"] == name]
        m = pooled[name]
        decode = decode_tokens_per_s([r for d in runs for r in d["result"].records])
        rows.append([
            name, isa, ", ".join(f"{d['metrics'].completion_tokens_per_s:.1f}" for d in runs),
            ", ".join(_rate(d["decode_tokens_per_s"]) for d in runs), _rate(decode),
            _ms(m.ttft.p50), _ms(m.itl.p50), _ms(m.itl.p99),
            f"{m.client_cpu_fraction:.0%}" if m.client_cpu_fraction is not None else "n/a",
            ", ".join(f"{d['other_processes_cores']:.2f}" for d in runs),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def versus_llama(scenario: Scenario, names: list[str], done: list[dict]) -> list[dict]:
    """Each pagewire server against llama-server's best type in this scenario, cycle by cycle
    (runs of one cycle are minutes apart at most) and by the mean over cycles."""
    llama = [n for n in names if n.startswith("llama:")]
    figures = {n: [headline(scenario, d) for d in done if d["config"] == n] for n in names}
    mean = {n: sum(v) / len(v) for n, v in figures.items() if v and None not in v}
    if not llama or not all(n in mean for n in llama):
        return []
    best = max(llama, key=lambda n: mean[n])
    out = []
    for name in names:
        if name.startswith("pagewire:") and name in mean:
            per_cycle = [ours / theirs for ours, theirs in zip(figures[name], figures[best])]
            out.append({"pagewire": name, "llama_best": best, "pagewire_mean": mean[name], "llama_best_mean": mean[best],
                        "ratio_of_means": mean[name] / mean[best], "ratio_per_cycle": per_cycle})
    return out


def cpu_table(names: list[str], done: list[dict]) -> str:
    """CPU ms per generated token of each process, the mean over a server's runs."""
    lines = ["CPU ms per generated token, by process (mean over runs):"]
    for name in names:
        per_run = [d["cpu_ms_per_token"] for d in done if d["config"] == name]
        roles = {role: sum(r.get(role, 0.0) for r in per_run) / len(per_run) for role in per_run[0]}
        cells = ", ".join(f"{role} {ms:.2f}" for role, ms in roles.items())
        lines.append(f"  {name}: {cells}; all {sum(roles.values()):.2f}")
    return "\n".join(lines) + "\n"


def run_all(args, ggufs, binary, texts: list[str]) -> tuple[dict[str, list[dict]], dict[ServerConfig, ServerConfig]]:
    """Every cycle, scenario and configuration in turn; (scenario name -> runs, configuration ->
    the one that ran: itself, or with --no-repack after llama-server died of SIGILL)."""
    done: dict[str, list[dict]] = {s.name: [] for s in args.scenarios}
    effective = {c: c for c in args.configs}
    for cycle in range(args.repeat_runs):
        for scenario in args.scenarios:
            sampling = make_sampling(max_tokens=scenario.max_new_tokens, temperature=0.0, ignore_eos=True)
            requests = build_requests(texts[:scenario.num_requests], sampling)
            warmup = build_requests(texts[scenario.num_requests:scenario.num_requests + scenario.concurrency],
                                    make_sampling(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True))
            for config in args.configs:
                print(f"cycle {cycle + 1}/{args.repeat_runs}, {scenario.name}: {effective[config].name}...",
                      file=sys.stderr, flush=True)
                try:
                    run = run_config(effective[config], scenario, args, ggufs, binary, warmup, requests)
                except IllegalInstruction as e:
                    if NO_REPACK in effective[config].args + tuple(args.llama_args):
                        raise
                    effective[config] = effective[config].with_args(NO_REPACK)
                    print(f"{e}: its repacked kernels use an instruction this CPU lacks; running it with {NO_REPACK} "
                          f"from now on ({effective[config].name})", file=sys.stderr, flush=True)
                    run = run_config(effective[config], scenario, args, ggufs, binary, warmup, requests)
                done[scenario.name].append(run | {"cycle": cycle + 1, "requested": config.name})
    return done, effective


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from scheduler_svc.api.tokenizer import Tokenizer
    from worker_svc.weights import default_gguf_path, resolve_model_path

    try:
        model_dir = resolve_model_path(None)  # the embedded model, converted to safetensors once
        root = cache_dir()
        llama_types = [c.dtype for c in args.configs if c.engine == "llama"]
        binary = None
        if llama_types:
            binary = Path(args.llama_server) if args.llama_server else find_or_build_server(root)
            if not binary.is_file():
                raise BenchError(f"--llama-server {binary}: no such file")
        ggufs = {t: default_gguf_path() if t == EMBEDDED_GGUF_TYPE else convert_to_gguf(root, model_dir, t)
                 for t in llama_types}
        tokenizer = Tokenizer(model_dir)
        # text prompts: each server tokenizes them itself (the usage check holds both to --prompt-len)
        most = max(s.num_requests + s.concurrency for s in args.scenarios)
        try:
            texts = word_prompts(most, args.prompt_len, tokenizer, run_rng(args.seed, 0, "prompts"))
        except ValueError as e:
            raise BenchError(f"prompts: {e}") from None
        isa = isa_text(cpu_info())
        print(f"{len(args.configs)} servers x {len(args.scenarios)} scenarios x {args.repeat_runs} cycle(s): "
              + "; ".join(f"{s.name}: {s.num_requests} requests over {s.concurrency} stream(s), {s.max_new_tokens} new "
                          "tokens" for s in args.scenarios)
              + f"; {args.prompt_len}-token prompts, greedy, ignore EOS; {args.threads} llama-server threads; ISA {isa}",
              file=sys.stderr, flush=True)
        done, effective = run_all(args, ggufs, binary, texts)
    except (BenchError, LlamaCppError) as e:
        print(f"vs_llamacpp: error: {e}", file=sys.stderr)
        return 2
    names = [effective[c].name for c in args.configs]
    report = {}
    for scenario in args.scenarios:
        runs = done[scenario.name]
        pooled = {n: pooled_metrics([(d["result"].records, d["result"].duration_s) for d in runs if d["config"] == n],
                                    client_cpu_fractions=[d["metrics"].client_cpu_fraction for d in runs
                                                          if d["config"] == n])
                  for n in names}
        versus = versus_llama(scenario, names, runs)
        sys.stdout.write(f"\n{scenario.name}: {scenario.num_requests} requests over {scenario.concurrency} stream(s), "
                         f"{scenario.max_new_tokens} new tokens each\n")
        sys.stdout.write(summary_table(names, runs, pooled, isa))
        what = "decode tok/s after the first token" if scenario.concurrency == 1 else "completion tok/s"
        for v in versus:
            sys.stdout.write(f"{v['pagewire']} vs llama-server's best here ({v['llama_best']}), {what}: "
                             f"{v['pagewire_mean']:.1f} against {v['llama_best_mean']:.1f}, {v['ratio_of_means']:.2f}x "
                             f"(per cycle: {', '.join(f'{r:.2f}x' for r in v['ratio_per_cycle'])})\n")
        sys.stdout.write(cpu_table(names, runs))
        report[scenario.name] = {
            "workload": {"num_requests": scenario.num_requests, "concurrency": scenario.concurrency,
                         "max_new_tokens": scenario.max_new_tokens, "prompt_len": args.prompt_len,
                         "warmup": f"{scenario.concurrency} requests x {WARMUP_TOKENS} tokens per server start"},
            "headline": what,
            "versus_llama_best": versus,
            "configs": {n: {"runs": [{"cycle": d["cycle"], "requested": d["requested"], "command_line": d["command_line"],
                                      "model": d["model"], "load_average_before": d["load_average_before"],
                                      "other_processes_cores": d["other_processes_cores"],
                                      "cpu_ms_per_token": d["cpu_ms_per_token"],
                                      "decode_tokens_per_s": d["decode_tokens_per_s"],
                                      **d["metrics"].to_dict()} for d in runs if d["config"] == n],
                            "decode_tokens_per_s": decode_tokens_per_s([r for d in runs if d["config"] == n
                                                                        for r in d["result"].records]),
                            "aggregate": pooled[n].to_dict()} for n in names},
        }
    if args.json:
        doc = {
            "command_line": shlex.join([sys.executable, *sys.argv]),
            "environment": environment(),
            "workload": {"prompt_len": args.prompt_len, "seed": args.seed, "temperature": 0.0, "ignore_eos": True,
                         "repeat_runs": args.repeat_runs},
            "llama_cpp": {"llama_cpp_python_version": LLAMA_CPP_PYTHON_VERSION, "binary": str(binary) if binary else None,
                          "threads": args.threads, "gguf": {t: str(p) for t, p in ggufs.items()},
                          "no_repack_after_sigill": [effective[c].name for c in args.configs if effective[c] != c]},
            "model_dir": str(model_dir),
            "configs": {effective[c].name: {"engine": c.engine, "dtype": c.dtype, "args": list(effective[c].args),
                                            "requested": c.name} for c in args.configs},
            "order": [(s, d["config"]) for s, runs in done.items() for d in runs],
            "scenarios": report,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(args.json, doc)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
