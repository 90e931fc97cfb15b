"""CPU per completion token of the scheduler and the worker under the null-worker load.

    python benchmarks/null_worker_cpu.py [--max-new-tokens 64] [--stream-interval 16]
        [--num-requests 2048] [--repeat-runs 3] [--concurrency 256] [--admission-turns N]

Starts `pagewire serve --worker null`, warms it up with one `pagewire bench --addr` run, then
reads the scheduler's and the worker's CPU time (user + system, from /proc) around the measured
`pagewire bench` runs and divides by the completion tokens they produced. CPU per token varies
far less from run to run than throughput on a shared VM, so it is the figure to compare changes
by; varying --max-new-tokens and --stream-interval separates per-request, per-token and
per-message costs (docs/benchmarks.md, section 3). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import grpc

from pagewire.bench.server import ServedServer, _child_pids, _free_port
from pagewire_common.v1 import generation_pb2 as pb
from pagewire_common.v1 import generation_pb2_grpc


def num_steps(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        return generation_pb2_grpc.GenerationStub(channel).GetStats(pb.StatsRequest(), timeout=10).num_steps


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def bench(addr: str, args, num_requests: int, runs: int, warmup: int) -> str:
    argv = [
        sys.executable, "-m", "pagewire.cli", "bench", "--addr", addr, "--num-requests", str(num_requests),
        "--concurrency", str(args.concurrency), "--max-new-tokens", str(args.max_new_tokens),
        "--prompt-len", "16", "--ignore-eos", "--repeat-runs", str(runs), "--warmup-runs", str(warmup),
        "--no-progress",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"pagewire bench failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=2048)
    p.add_argument("--repeat-runs", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--admission-turns", type=int, default=None, help="passed to `pagewire serve` when given")
    args = p.parse_args()

    addr = f"127.0.0.1:{_free_port()}"
    server = ServedServer(
        [sys.executable, "-m", "pagewire.cli", "serve", "--worker", "null", "--listen", addr,
         "--max-num-seqs", str(args.concurrency), "--stream-interval", str(args.stream_interval)]
        + ([] if args.admission_turns is None else ["--admission-turns", str(args.admission_turns)]),
        addr,
    )
    server.start(timeout=120)
    try:
        workers = _child_pids(server.proc.pid)
        if len(workers) != 1:
            raise SystemExit(f"expected one worker process under `pagewire serve`, found {workers}")
        worker = workers[0]
        bench(addr, args, min(args.num_requests, 1024), runs=1, warmup=0)  # warm up
        steps0 = num_steps(addr)
        sched0, worker0 = cpu_seconds(server.proc.pid), cpu_seconds(worker)
        out = bench(addr, args, args.num_requests, runs=args.repeat_runs, warmup=0)
        sched1, worker1 = cpu_seconds(server.proc.pid), cpu_seconds(worker)
        steps1 = num_steps(addr)
    finally:
        server.stop()
    tokens = args.num_requests * args.max_new_tokens * args.repeat_runs
    rates = [float(x.replace(",", "")) for x in re.findall(r"([\d,]+\.\d) output tok/s", out)]
    client = [int(x) for x in re.findall(r"client CPU (\d+)%", out)]
    print(f"{args.repeat_runs} runs x {args.num_requests} requests x {args.max_new_tokens} tokens, "
          f"stream interval {args.stream_interval}, {args.concurrency} streams")
    print(f"completion tok/s per run: {', '.join(f'{r:,.0f}' for r in rates)}")
    print(f"scheduler CPU per token: {1e6 * (sched1 - sched0) / tokens:.2f} us")
    print(f"worker CPU per token:    {1e6 * (worker1 - worker0) / tokens:.2f} us")
    print(f"scheduler CPU per request: {1e6 * (sched1 - sched0) / (args.num_requests * args.repeat_runs):.0f} us")
    print(f"steps: {steps1 - steps0}, {tokens / max(steps1 - steps0, 1):.1f} tokens per step "
          f"(out of at most {args.concurrency} sequences)")
    if client:
        print(f"bench client CPU: {', '.join(f'{c}%' for c in client)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
