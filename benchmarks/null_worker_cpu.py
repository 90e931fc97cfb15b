"""CPU per streamed token of every process of `pagewire serve --worker null`, for several numbers
of API servers in one invocation. Feeds docs/benchmarks.md, section "3. Control plane".

    python benchmarks/null_worker_cpu.py [--api-servers 1,2] [--max-new-tokens 64] [--stream-interval 1]
        [--num-requests 2048] [--repeat-runs 2] [--concurrency 256] [--json PATH]

For each API-server count it starts `pagewire serve --worker null --api-servers N`, warms it up
with one `pagewire bench --addr` run, then reads the CPU time (user + system, from /proc) of the
core, of each API server and its helpers (tokenizer helper, resource tracker), of the worker and of
serve itself around the measured runs (pagewire.bench.procs, which `pagewire bench --serve` reads
too), and divides by the completion tokens streamed. CPU per token varies far less from
run to run than throughput on a shared VM, so it is the figure to compare by, and it gives the
ceiling of a machine with enough cores: tokens/s = min over tiers of (processes in the tier /
CPU seconds per token of one). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import grpc

from pagewire.bench.procs import cpu_by_role, serve_roles
from pagewire.bench.report import cpu_info, environment
from pagewire.bench.server import ServedServer, free_port
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc


def num_steps(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetStats(pb.StatsRequest(), timeout=10).num_steps


def bench(addr: str, args, num_requests: int, runs: int) -> str:
    argv = [
        sys.executable, "-m", "pagewire.cli", "bench", "--addr", addr, "--num-requests", str(num_requests),
        "--concurrency", str(args.concurrency), "--max-new-tokens", str(args.max_new_tokens),
        "--prompt-len", "16", "--ignore-eos", "--repeat-runs", str(runs), "--warmup-runs", "0", "--no-progress",
    ]
    if args.client_processes:
        argv += ["--client-processes", str(args.client_processes)]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"pagewire bench failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


def measure(num_api_servers: int, args) -> dict:
    addr = f"127.0.0.1:{free_port()}"
    server = ServedServer(
        [sys.executable, "-m", "pagewire.cli", "serve", "--worker", "null", "--listen", addr,
         "--max-num-seqs", str(args.concurrency), "--stream-interval", str(args.stream_interval),
         "--api-servers", str(num_api_servers), *args.serve_args.split()],
        addr,
    )
    server.start(timeout=180)
    try:
        roles = serve_roles(server.proc.pid)
        expected = {"serve", "worker", "core", *(f"api-server {i}" for i in range(1, num_api_servers + 1))}
        if {role for role in roles if not role.endswith(" helpers")} != expected:
            raise SystemExit(f"unexpected process tree under `pagewire serve`: {roles}")
        bench(addr, args, min(args.num_requests, 1024), runs=1)  # warm up
        steps0, cpu0 = num_steps(addr), cpu_by_role(roles, waited_children=True)
        out = bench(addr, args, args.num_requests, runs=args.repeat_runs)
        cpu1, steps1 = cpu_by_role(roles, waited_children=True), num_steps(addr)
    finally:
        server.stop()
    tokens = args.num_requests * args.max_new_tokens * args.repeat_runs
    rates = [float(x.replace(",", "")) for x in re.findall(r"([\d,]+\.\d) output tok/s", out)]
    us_per_token = {role: 1e6 * (cpu1[role] - cpu0[role]) / tokens for role in roles}
    api = [us_per_token[r] for r in roles if r.startswith("api-server")]
    return {
        "api_servers": num_api_servers,
        "tokens": tokens,
        "steps": steps1 - steps0,
        "tokens_per_step": tokens / max(steps1 - steps0, 1),
        "completion_tok_s": rates,
        "cpu_us_per_token": us_per_token,
        "api_server_us_per_token": sum(api),  # all API servers together: the tier's cost per token
        "client_cpu": [int(x) for x in re.findall(r"client CPU (\d+)%", out)],
        # time to first token over the measured runs together: how long new calls wait to get in
        **{f"ttft_{q}_ms": _table_value(out, f"TTFT {q} (ms)") for q in ("p50", "p99")},
    }


def _table_value(out: str, metric: str) -> float | None:
    """A metric's value in `pagewire bench`'s summary table."""
    m = re.search(re.escape(metric) + r"\s+([\d,]+\.?\d*)", out)
    return float(m.group(1).replace(",", "")) if m else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--api-servers", default="1,2", help="comma-separated API-server counts (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--num-requests", type=int, default=2048)
    p.add_argument("--repeat-runs", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--client-processes", type=int, default=None, help="passed to `pagewire bench`")
    p.add_argument("--serve-args", default="", metavar="ARGS", help="more flags for `pagewire serve`, e.g. '--admission-turns 0'")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    results = [measure(int(n), args) for n in args.api_servers.split(",")]
    print(f"{args.repeat_runs} runs x {args.num_requests} requests x {args.max_new_tokens} tokens, stream interval "
          f"{args.stream_interval}, {args.concurrency} streams, {os.cpu_count()} cores ({cpu_info()['cpu_isa']})")
    for r in results:
        cpu = r["cpu_us_per_token"]
        per_role = ", ".join(f"{role} {us:.1f}" for role, us in cpu.items())
        core, api = cpu["core"], r["api_server_us_per_token"]
        print(f"--api-servers {r['api_servers']}: {', '.join(f'{x:,.0f}' for x in r['completion_tok_s'])} tok/s; "
              f"CPU us/token: {per_role}; {r['tokens_per_step']:.0f} tokens/step; TTFT p50 {r['ttft_p50_ms']} ms")
        need = -(-50_000 * api // 1e6)
        print(f"   ceiling with a core per process: the core {1e6 / core:,.0f} tok/s; each API server "
              f"{1e6 / api:,.0f} tok/s, so {need:.0f} API servers for 50,000 tok/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "environment": environment(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
