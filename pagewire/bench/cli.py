"""``pagewire bench``: load a pagewire server over gRPC, measure at the client, compare with
Hugging Face baselines run in this process.

Flow: (optionally) start ``pagewire serve`` as a child process and wait for "pagewire ready";
connect and read the served model's info; build each run's prompts from the seed; run the warmup
runs (not measured) and the measured runs; stop the child; run the requested baselines on the
same prompts; print the summary table; write ``--json`` and ``--plot``.

This module only defines arguments at import time (``pagewire --help`` stays fast); grpc, torch,
transformers and matplotlib are imported when a bench actually runs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pagewire.cli import _bytes_size, _positive_int

BASELINE_NAMES = ("hf", "hf-cb")
DEFAULT_ADDR = "127.0.0.1:50051"
DEFAULT_CONCURRENCY = 64
DEFAULT_PROMPT_LEN = "128"
# warn when the busiest client process used more than this share of a core
CLIENT_BUSY_WARNING = 0.8
# server-side engine options passed through to `pagewire serve` with --serve: (flag, dest, kind)
_PASSTHROUGH = (
    ("--model", "model", "value"),
    ("--dtype", "dtype", "value"),
    ("--device", "device", "value"),
    ("--block-size", "block_size", "value"),
    ("--num-kv-blocks", "num_kv_blocks", "value"),
    ("--kv-cache-memory", "kv_cache_bytes", "value"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", "value"),
    ("--max-num-seqs", "max_num_seqs", "value"),
    ("--no-prefix-cache", "no_prefix_cache", "flag"),
    ("--no-overlap", "no_overlap", "flag"),
    ("--stream-interval", "stream_interval", "value"),
    ("--num-threads", "num_threads", "value"),
    ("--worker", "worker", "value"),
)

EXAMPLES = """\
examples:
  # start a server on the embedded SmolLM2, measure it, compare with transformers
  pagewire bench --serve --num-requests 64 --concurrency 16 --max-new-tokens 64 --ignore-eos --baseline hf,hf-cb

  # the control-plane ceiling: a worker that does no math
  pagewire bench --serve --worker null --num-requests 512 --concurrency 256 --max-new-tokens 64 --ignore-eos --prompt-len 16

  # a server that is already running; Poisson arrivals at 20 req/s, mixed prompt lengths
  pagewire bench --addr 127.0.0.1:50051 --request-rate 20 --prompt-len 16-512 --json out.json --plot out.png

  # prefix-cache workload: the same text, alone and repeated 4 times
  pagewire bench --serve --prompt "The history of the lighthouse. " --prompt-repeats 1,4 --no-prefix-cache

metrics (all measured at the client with time.perf_counter):
  TTFT  send -> first token          TPOT  (last token - first token) / (n - 1), requests with n >= 2
  ITL   every gap between token arrivals, pooled (k tokens in one response: one arrival + k-1 zero gaps)
  E2E   send -> last response        throughput: completion and prompt+completion tokens/s, requests/s over wall time
  percentiles: linear interpolation between closest ranks (numpy's default); ratios > 1 mean pagewire is better.
"""


class BenchError(Exception):
    """A problem the user can fix (bad flags, no server, server failed to start)."""


# ---- arguments -------------------------------------------------------------------------------


def _prompt_len(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '16-512' -> (16, 512)."""
    parts = text.split("-")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a length like 128 or a range like 16-512, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= low <= high, got {text!r}")
    return lo, hi


def _repeats(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts like 1,4, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"repeat counts must be >= 1, got {text!r}")
    return values


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``pagewire``'s subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="measure a server's throughput and latency at the client (optionally vs transformers)",
        description="Send a workload to a pagewire server over gRPC (one asyncio client, many streams) and report "
        "TTFT, TPOT, ITL, end-to-end latency and throughput measured at the client. The server is the one at --addr, "
        "or one started for the bench with --serve. --baseline runs Hugging Face transformers on the same prompts "
        "in this process for comparison.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = _serve_defaults()
    g = p.add_argument_group("server")
    g.add_argument("--addr", default=None,
                   help=f"the server to measure (default: {DEFAULT_ADDR}); with --serve, where the started server "
                   "listens (default then: a free port on 127.0.0.1)")
    g.add_argument("--serve", action="store_true",
                   help="start `pagewire serve` as a child process with the engine options below, wait for "
                   "'pagewire ready', and stop it (SIGTERM) at the end")
    g.add_argument("--connect-timeout", type=_positive_float, default=10.0,
                   help="seconds to wait for the server at --addr to answer (default: %(default)s)")
    g.add_argument("--serve-timeout", type=_positive_float, default=600.0,
                   help="seconds to wait for a --serve server to be ready (the first start of the embedded model "
                   "converts it, ~25 s) (default: %(default)s)")
    g.add_argument("--server-log", default=None, metavar="PATH",
                   help="with --serve, write the server's output to PATH (default: kept in memory and shown only "
                   "if it fails)")

    g = p.add_argument_group("engine (passed to the server with --serve; used by the baselines)")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct). "
                   "Without --serve it names the local copy of the served model, used for its tokenizer's special "
                   "tokens and by the baselines")
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help=f"weights and KV cache dtype (default: the server's, {d['dtype']}; baselines use the "
                   "dtype the server reports)")
    g.add_argument("--device", default=None, help="torch device for the server and the baselines (default: cuda if "
                   "available, else cpu)")
    g.add_argument("--block-size", type=_positive_int, default=None, help=f"tokens per KV block (default: the "
                   f"server's, {d['block_size']}); hf-cb uses it as its page size")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="KV blocks to allocate (default: as many as --kv-cache-memory holds); hf-cb gets the same "
                   "number of blocks as the server reports")
    g.add_argument("--kv-cache-memory", dest="kv_cache_bytes", type=_bytes_size, default=None, metavar="SIZE",
                   help="memory for the KV cache, e.g. 2G (default: 1G on CPU, 90%% of free GPU memory)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None,
                   help=f"token budget of one step (default: the server's, {d['max_num_batched_tokens']}); hf-cb's "
                   "max_batch_tokens")
    g.add_argument("--max-num-seqs", type=_positive_int, default=None,
                   help=f"most sequences running at once (default: the server's, {d['max_num_seqs']}); hf-cb's "
                   "max_requests_per_batch")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off (the server's and "
                   "hf-cb's block sharing)")
    g.add_argument("--no-overlap", action="store_true",
                   help="the server waits for each step's result before sending the next plan")
    g.add_argument("--num-threads", type=int, default=None,
                   help="the worker's CPU threads (default: the server's, one per core)")
    g.add_argument("--stream-interval", type=int, default=None,
                   help="tokens per response after the first (default: the server's, 1)")
    g.add_argument("--worker", choices=["model", "null"], default=None,
                   help="null: a worker that does no model math and returns fixed tokens, to measure the control "
                   "plane's ceiling (scheduler + gRPC + streaming); needs --serve; no baselines (default: model)")

    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=_positive_int, default=256, help="requests per run (default: %(default)s)")
    g.add_argument("--concurrency", type=_positive_int, default=None,
                   help=f"closed loop: keep this many requests in flight (default: {DEFAULT_CONCURRENCY} unless "
                   "--request-rate is given)")
    g.add_argument("--request-rate", type=_positive_float, default=None,
                   help="open loop: send requests as Poisson arrivals at this many per second (from --seed), "
                   "whatever is in flight; exclusive with --concurrency")
    g.add_argument("--seed", type=int, default=0,
                   help="seed of prompts and arrival times: same seed, same workload (each run gets its own "
                   "prompts derived from it, so runs do not hit each other's prefix cache) (default: %(default)s)")
    g.add_argument("--prompt-len", type=_prompt_len, default=None, metavar="N|LO-HI",
                   help=f"prompts of N random token ids (special tokens excluded), or of lengths drawn uniformly "
                   f"from LO-HI (default: {DEFAULT_PROMPT_LEN})")
    g.add_argument("--prompt", default=None, metavar="TEXT",
                   help="use this text as every prompt instead of random ids (exclusive with --prompt-len)")
    g.add_argument("--prompt-repeats", type=_repeats, default=None, metavar="K1,K2,...",
                   help="with --prompt: request i sends the text repeated K times, K cycling over the list "
                   "(default: 1)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate per request "
                   "(default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens tokens (keep going past EOS), so every engine produces "
                   "the same number of tokens")
    g.add_argument("--temperature", type=_non_negative_float, default=0.0,
                   help="0 is greedy; > 0 samples with top-k/top-p off (default: %(default)s)")
    g.add_argument("--warmup-runs", type=_non_negative_int, default=1,
                   help="runs of the same shape before measuring, not reported (default: %(default)s)")
    g.add_argument("--repeat-runs", type=_positive_int, default=1,
                   help="measured runs; the summary pools them (default: %(default)s)")
    g.add_argument("--client-processes", type=_positive_int, default=None, metavar="N",
                   help="load-generator processes sharing the streams (each one asyncio loop and one gRPC channel); "
                   "one Python process handles some tens of thousands of streamed messages/s, so raise this when "
                   "the summary says the client was busy (default: 1, or concurrency/64 up to cpus/4 and 4)")
    g.add_argument("--request-timeout", type=_positive_float, default=None,
                   help="deadline of each request in seconds; one that passes it counts as failed (default: none)")

    g = p.add_argument_group("baselines (Hugging Face transformers, in this process, same model and prompts)")
    g.add_argument("--baseline", action="append", default=[], metavar="NAME[,NAME]",
                   help="hf: model.generate on static batches (left padding; only throughput and per-batch "
                   "latency are observable); hf-cb: transformers' continuous batching (per-token times). "
                   "Repeatable or comma-separated")
    g.add_argument("--baseline-batch-size", type=_positive_int, default=None,
                   help="prompts per static batch for hf (default: --concurrency, or 32 with --request-rate)")

    g = p.add_argument_group("output")
    g.add_argument("--json", default=None, metavar="PATH",
                   help="write every run, the aggregates, the ratios, the exact command line and the environment "
                   "(torch version, CPU count, GPU) as JSON")
    g.add_argument("--plot", default=None, metavar="PATH.png",
                   help="plot TTFT, ITL and E2E latency distributions (histograms and CDFs); needs matplotlib "
                   "(pip install 'pagewire[bench]')")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse_baselines(values: list[str]) -> list[str]:
    out: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip()
            if not name:
                continue
            if name not in BASELINE_NAMES:
                raise BenchError(f"unknown baseline {name!r}; choose from {', '.join(BASELINE_NAMES)}")
            if name not in out:
                out.append(name)
    return out


def validate_args(args) -> None:
    """Check flag combinations; fill derived defaults (concurrency, prompt length, baselines)."""
    if args.concurrency is not None and args.request_rate is not None:
        raise BenchError("give --concurrency (closed loop) or --request-rate (Poisson arrivals), not both")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = DEFAULT_CONCURRENCY
    if args.prompt is not None and args.prompt_len is not None:
        raise BenchError("give --prompt (fixed text) or --prompt-len (random token ids), not both")
    if args.prompt is not None and not args.prompt:
        raise BenchError("--prompt is empty")
    if args.prompt_repeats is not None and args.prompt is None:
        raise BenchError("--prompt-repeats needs --prompt")
    if args.prompt is None and args.prompt_len is None:
        args.prompt_len = _prompt_len(DEFAULT_PROMPT_LEN)
    if args.prompt is not None and args.prompt_repeats is None:
        args.prompt_repeats = [1]
    args.baselines = parse_baselines(args.baseline)
    if args.worker is not None and not args.serve:
        raise BenchError("--worker applies to the server the bench starts: add --serve")
    if args.worker == "null" and args.baselines:
        raise BenchError("--worker null runs no model, so there is nothing to compare with --baseline")
    if args.server_log is not None and not args.serve:
        raise BenchError("--server-log needs --serve")
    if args.client_processes is None:
        streams = args.concurrency or DEFAULT_CONCURRENCY
        args.client_processes = max(1, min(4, streams // 64, (os.cpu_count() or 1) // 4))
    if args.concurrency is not None and args.client_processes > args.concurrency:
        raise BenchError(f"--client-processes ({args.client_processes}) is more than --concurrency ({args.concurrency})")
    if args.baseline_batch_size is None:
        args.baseline_batch_size = args.concurrency or 32
    if args.plot is not None:
        from pagewire.bench.report import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as e:
            raise BenchError(str(e)) from None
    if not args.serve:
        # the baselines follow what the running server reports (dtype, block size, KV blocks)
        server_only = [flag for flag, dest, _kind in _PASSTHROUGH
                       if dest in ("dtype", "block_size", "num_kv_blocks", "kv_cache_bytes", "no_overlap", "stream_interval")
                       and getattr(args, dest) not in (None, False)]
        if server_only:
            print(f"pagewire bench: note: {', '.join(server_only)} only configure a server started with --serve; "
                  f"the server at {args.addr or DEFAULT_ADDR} keeps its own settings", file=sys.stderr)


# ---- the served server ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_can_listen(addr: str) -> None:
    """Fail early, and clearly, when --serve cannot listen on ``addr`` (HOST:PORT)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise BenchError(f"--addr {addr!r} is not HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        raise BenchError(f"--addr {addr!r}: {e}") from None
    family, _type, _proto, _name, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(sockaddr)
        except OSError as e:
            raise BenchError(
                f"--serve cannot listen on {addr} ({e.strerror}); if a pagewire server already runs there, "
                f"drop --serve to measure it"
            ) from None


def serve_argv(args, listen: str) -> list[str]:
    """The `pagewire serve` command line for --serve, with the engine options that were given."""
    argv = [sys.executable, "-m", "pagewire.cli", "--log-level", args.log_level, "serve", "--listen", listen]
    for flag, dest, kind in _PASSTHROUGH:
        value = getattr(args, dest)
        if kind == "flag":
            if value:
                argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


class ServedServer:
    """`pagewire serve` as a child process in its own session: started, awaited until it prints
    "pagewire ready", and stopped with SIGTERM (SIGKILL for it and its worker if that fails)."""

    READY = "pagewire ready"

    def __init__(self, argv: list[str], addr: str, log_path: str | None = None):
        self.argv = argv
        self.addr = addr
        self.log_path = log_path
        self.tail: collections.deque[str] = collections.deque(maxlen=60)
        self.ready = threading.Event()
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read_output, name="pagewire-bench-server-log", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.1):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise BenchError(
                    f"the server (`{shlex.join(self.argv[3:])}`) exited with code {self.proc.returncode} before it "
                    f"was ready; its last output:\n{self.output_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"the server was not ready within {timeout:g}s; its last output:\n{self.output_tail()}")

    def _read_output(self) -> None:
        log = open(self.log_path, "w") if self.log_path else None
        try:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                self.tail.append(line)
                if log is not None:
                    log.write(line)
                    log.flush()
                if self.READY in line:
                    self.ready.set()
        finally:
            if log is not None:
                log.close()

    def output_tail(self) -> str:
        return "".join(self.tail).rstrip() or "(no output)"

    def stop(self, timeout: float = 60.0) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            children = _child_pids(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"pagewire bench: the server did not stop within {timeout:g}s; killing it", file=sys.stderr)
                children = children or _child_pids(proc.pid)
                proc.kill()
                proc.wait()
                for pid in children:  # the worker runs in a session of its own
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if self._reader is not None:
            self._reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode


def _child_pids(pid: int) -> list[int]:
    pids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return pids


# ---- the bench -----------------------------------------------------------------------------


def _serve_defaults() -> dict:
    """The defaults of `pagewire serve`'s engine options (for the baselines and the report when a
    flag is not given), read from its own parser so they never drift."""
    from pagewire.cli import add_scheduler_options, add_worker_options

    p = argparse.ArgumentParser(add_help=False)
    add_worker_options(p)
    add_scheduler_options(p)
    return vars(p.parse_args([]))


class Bench:
    def __init__(self, args):
        self.args = args
        self.baselines: list[str] = args.baselines
        self.defaults = _serve_defaults()
        self.model_dir: Path | None = None
        self.tokenizer = None  # scheduler_svc.tokenizer.Tokenizer of the local model copy, if any
        self.model_info = None
        self.run_prompts: list[list] = []  # per run index (warmups first): token-id lists or texts
        self.run_offsets: list[list[float] | None] = []

    def option(self, dest: str):
        value = getattr(self.args, dest)
        return self.defaults[dest] if value is None else value

    @property
    def num_runs(self) -> int:
        return self.args.warmup_runs + self.args.repeat_runs

    def run_label(self, engine: str, index: int) -> str:
        w = self.args.warmup_runs
        return f"{engine} warmup {index + 1}/{w}" if index < w else f"{engine} run {index - w + 1}/{self.args.repeat_runs}"

    def progress(self, label: str):
        from tqdm import tqdm

        return tqdm(total=self.args.num_requests, desc=label, unit="req", file=sys.stderr, leave=False,
                    disable=True if self.args.no_progress else None, dynamic_ncols=True)

    # ---- setup ---------------------------------------------------------------------------------

    def resolve_local_model(self) -> None:
        """The local copy of the model: for --serve, baselines, or when --model is given."""
        args = self.args
        if not (args.serve or self.baselines or args.model is not None):
            return
        from scheduler_svc.tokenizer import Tokenizer

        given = Path(args.model).expanduser() if args.model is not None else None
        if given is not None and (given / "config.json").is_file():
            self.model_dir = given  # a model directory as is: no need to import torch here
        else:
            from worker_svc.weights import resolve_model_path  # converts a .gguf once (imports torch)

            self.model_dir = resolve_model_path(args.model)
        if (self.model_dir / "tokenizer.json").is_file():
            self.tokenizer = Tokenizer(self.model_dir)
        elif args.prompt is not None and self.baselines:
            raise BenchError(f"--prompt with --baseline needs the model's tokenizer.json, not found in {self.model_dir}")

    def build_workload(self) -> None:
        """Every run's prompts (and Poisson send times), fixed before anything is measured."""
        from pagewire.bench.loadgen import poisson_offsets, random_prompts, run_rng, text_prompts

        args = self.args
        info = self.model_info
        n = args.num_requests
        if args.prompt is not None:
            prompts = text_prompts(n, args.prompt, args.prompt_repeats)
            self.run_prompts = [prompts] * self.num_runs
            if self.tokenizer is not None:
                longest = max(len(self.tokenizer.encode(args.prompt * k)) for k in set(args.prompt_repeats))
                self._check_length(longest)
        else:
            excluded = set(info.eos_token_ids)
            vocab = info.vocab_size
            if self.tokenizer is not None:
                excluded |= self.tokenizer.special_token_ids
                vocab = min(vocab, self.tokenizer.vocab_size)
            self._check_length(args.prompt_len[1])
            self.run_prompts = [
                random_prompts(n, args.prompt_len, vocab, excluded, run_rng(args.seed, i, "prompts"))
                for i in range(self.num_runs)
            ]
        if args.request_rate is not None:
            self.run_offsets = [poisson_offsets(n, args.request_rate, run_rng(args.seed, i, "arrivals"))
                                for i in range(self.num_runs)]
        else:
            self.run_offsets = [None] * self.num_runs

    def _check_length(self, longest_prompt: int) -> None:
        limit = self.model_info.max_model_len
        if longest_prompt + self.args.max_new_tokens > limit:
            raise BenchError(
                f"the longest prompt ({longest_prompt} tokens) + --max-new-tokens ({self.args.max_new_tokens}) "
                f"exceeds the served model's length limit of {limit} tokens"
            )

    # ---- ours ----------------------------------------------------------------------------------

    async def run_ours(self, addr: str) -> list:
        """Connect, build the workload, run warmups and measured runs; the measured runs' LoadResults."""
        from pagewire.bench.loadgen import Client, ClientPool, ServerUnreachable, build_requests
        from pagewire.client import make_sampling

        args = self.args
        client = Client(addr)
        pool = None
        try:
            try:
                self.model_info = await client.wait_ready(args.connect_timeout)
                if args.client_processes > 1:
                    pool = await asyncio.get_running_loop().run_in_executor(
                        None, ClientPool, addr, args.client_processes
                    )
            except ServerUnreachable as e:
                raise BenchError(str(e)) from None
            self.check_model_matches()
            self.build_workload()
            sampling = make_sampling(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                     ignore_eos=args.ignore_eos)
            runner = pool or client
            measured = []
            for i in range(self.num_runs):
                requests = build_requests(self.run_prompts[i], sampling)
                label = self.run_label("pagewire", i)
                with self.progress(label) as bar:
                    result = await runner.run(
                        requests,
                        concurrency=args.concurrency,
                        arrival_offsets=self.run_offsets[i],
                        request_timeout=args.request_timeout,
                        progress=bar,
                    )
                self.log_run(label, result.records, result.duration_s, result.client_cpu_fraction)
                if i >= args.warmup_runs:
                    measured.append(result)
            return measured
        finally:
            if pool is not None:
                pool.close()
            await client.close()

    def check_model_matches(self) -> None:
        info = self.model_info
        if self.baselines and self.model_dir is not None and info.model_name != self.model_dir.name:
            print(f"pagewire bench: note: the server serves {info.model_name!r}; the baselines load "
                  f"{self.model_dir} (pass --model to name the same model)", file=sys.stderr)

    def log_run(self, label: str, records, duration: float, client_cpu: float | None = None) -> None:
        from pagewire.bench.metrics import run_metrics

        m = run_metrics(records, duration)
        failed = f", {m.num_failed} failed ({', '.join(f'{k}: {v}' for k, v in m.errors.items())})" if m.num_failed else ""
        cpu = "" if client_cpu is None else f", client CPU {client_cpu:.0%}"
        print(f"{label}: {m.num_requests} requests in {duration:.3f}s, {m.completion_tokens_per_s:,.1f} output tok/s"
              f"{cpu}{failed}", file=sys.stderr, flush=True)
        if m.num_failed:
            first = next(r for r in records if not r.ok)
            print(f"  first failure: {first.error}: {first.error_message}", file=sys.stderr)

    # ---- baselines -----------------------------------------------------------------------------

    def baseline_options(self):
        from pagewire.bench.baselines import BaselineOptions

        args = self.args
        info = self.model_info
        return BaselineOptions(
            model_dir=self.model_dir,
            dtype=info.dtype or self.option("dtype"),
            device=args.device,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
            seed=args.seed,
            batch_size=args.baseline_batch_size,
            block_size=info.block_size or self.option("block_size"),
            num_kv_blocks=info.num_kv_blocks or None,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_batched_tokens=self.option("max_num_batched_tokens"),
            max_num_seqs=self.option("max_num_seqs"),
            prefix_cache=not args.no_prefix_cache,
        )

    def baseline_prompts(self, i: int) -> list[list[int]]:
        prompts = self.run_prompts[i]
        if prompts and isinstance(prompts[0], str):
            return [self.tokenizer.encode(p) for p in prompts]
        return prompts

    def run_baselines(self):
        from pagewire.bench.baselines import HFBaselines
        from pagewire.bench.metrics import pooled_metrics, run_metrics
        from pagewire.bench.report import EngineResult

        args = self.args
        print(f"loading {self.model_dir} with transformers for the baselines...", file=sys.stderr, flush=True)
        hf = HFBaselines(self.baseline_options())
        results = []
        for name in self.baselines:
            measured = []
            for i in range(self.num_runs):
                label = self.run_label(name, i)
                prompts = self.baseline_prompts(i)
                with self.progress(label) as bar:
                    if name == "hf":
                        records, duration = hf.run_static(prompts, progress=bar)
                    else:
                        records, duration = hf.run_continuous(
                            prompts, concurrency=args.concurrency, arrival_offsets=self.run_offsets[i], progress=bar
                        )
                self.log_run(label, records, duration)
                if i >= args.warmup_runs:
                    measured.append((records, duration))
            per_token = name != "hf"
            details = hf.describe()
            if name == "hf":
                details["batch_size"] = args.baseline_batch_size
            else:
                cb = hf.last_cb_config
                details["continuous_batching_config"] = {
                    "page_size": cb.page_size, "num_blocks": cb.num_blocks, "max_batch_tokens": cb.max_batch_tokens,
                    "max_requests_per_batch": cb.max_requests_per_batch, "allow_block_sharing": cb.allow_block_sharing,
                }
            results.append(EngineResult(
                name=name,
                runs=[run_metrics(r, d, per_token=per_token) for r, d in measured],
                aggregate=pooled_metrics(measured, per_token=per_token),
                records=[rec for r, _ in measured for rec in r],
                per_token=per_token,
                details=details,
            ))
        return results

    # ---- report --------------------------------------------------------------------------------

    def header(self, addr: str) -> list[str]:
        args = self.args
        info = self.model_info
        mode = (f"concurrency {args.concurrency}" if args.concurrency is not None
                else f"Poisson arrivals at {args.request_rate:g} req/s (seed {args.seed})")
        if args.prompt is not None:
            prompt = f"text prompt x {','.join(map(str, args.prompt_repeats))}"
        else:
            lo, hi = args.prompt_len
            prompt = f"{lo} random tokens" if lo == hi else f"{lo}-{hi} random tokens"
        sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
        eos = ", ignore EOS" if args.ignore_eos else ""
        worker = " [null worker: no model math]" if args.worker == "null" else ""
        return [
            f"pagewire bench: {args.num_requests} requests x {args.repeat_runs} run(s) (+{args.warmup_runs} warmup), "
            f"{mode}",
            f"prompt: {prompt}; up to {args.max_new_tokens} new tokens{eos}; {sampling}",
            f"server: {addr}{' (started by the bench)' if args.serve else ''}: {info.model_name}, {info.dtype} on "
            f"{info.device}, {info.num_kv_blocks} KV blocks x {info.block_size}{worker}",
        ]

    def config_dict(self) -> dict:
        args = self.args
        keys = ("num_requests", "concurrency", "request_rate", "seed", "prompt_len", "prompt", "prompt_repeats",
                "max_new_tokens", "ignore_eos", "temperature", "warmup_runs", "repeat_runs", "request_timeout",
                "baselines", "baseline_batch_size", "serve", "worker", "client_processes")
        out = {k: getattr(args, k) for k in keys}
        out["prompt_len"] = list(args.prompt_len) if args.prompt_len else None
        out["worker"] = args.worker or "model"
        out["engine"] = {dest: self.option(dest) for _flag, dest, _kind in _PASSTHROUGH if dest != "worker"}
        out["engine"]["model"] = str(self.model_dir) if self.model_dir else args.model
        return out

    def server_dict(self, addr: str) -> dict:
        info = self.model_info
        return {
            "addr": addr,
            "started_by_bench": bool(self.args.serve),
            "model_info": {
                "model_name": info.model_name, "max_model_len": info.max_model_len, "vocab_size": info.vocab_size,
                "block_size": info.block_size, "num_kv_blocks": info.num_kv_blocks, "dtype": info.dtype,
                "device": info.device, "eos_token_ids": list(info.eos_token_ids),
            },
        }

    # ---- main ----------------------------------------------------------------------------------

    def run(self) -> int:
        from pagewire.bench.metrics import pooled_metrics, run_metrics
        from pagewire.bench.report import EngineResult, environment, json_document, summary_text, write_json, write_plot

        args = self.args
        server = None
        if args.serve:
            addr = args.addr or f"127.0.0.1:{_free_port()}"
            check_can_listen(addr)
            server = ServedServer(serve_argv(args, addr), addr, args.server_log)
        else:
            addr = args.addr or DEFAULT_ADDR
        self.resolve_local_model()
        if server is not None:
            print(f"pagewire bench: starting `pagewire serve` on {addr}...", file=sys.stderr, flush=True)
        try:
            if server is not None:
                server.start(args.serve_timeout)
            measured = asyncio.run(self.run_ours(addr))
        finally:
            if server is not None:
                code = server.stop()
                if code not in (0, None):
                    print(f"pagewire bench: the server exited with code {code}; its last output:\n"
                          f"{server.output_tail()}", file=sys.stderr)
        cpu = [m.client_cpu_fraction for m in measured]
        results = [EngineResult(
            name="pagewire",
            runs=[run_metrics(m.records, m.duration_s, client_cpu_fraction=m.client_cpu_fraction) for m in measured],
            aggregate=pooled_metrics([(m.records, m.duration_s) for m in measured], client_cpu_fractions=cpu),
            records=[rec for m in measured for rec in m.records],
            details={"addr": addr, "client_processes": args.client_processes},
        )]
        if self.baselines:
            results += self.run_baselines()
            ours_tokens = results[0].aggregate.completion_tokens
            for r in results[1:]:
                if r.aggregate.completion_tokens != ours_tokens:
                    print(f"pagewire bench: note: {r.name} produced {r.aggregate.completion_tokens} completion tokens, "
                          f"pagewire {ours_tokens}{'' if args.ignore_eos else ' (use --ignore-eos to equalise)'}",
                          file=sys.stderr)
        header = self.header(addr)
        sys.stdout.write(summary_text(results, header))
        sys.stdout.flush()
        if args.json:
            doc = json_document(
                results, argv=list(sys.argv), command_line=shlex.join(sys.argv), config=self.config_dict(),
                server=self.server_dict(addr), env=environment(),
            )
            write_json(args.json, doc)
            print(f"wrote {args.json}", file=sys.stderr)
        if args.plot:
            write_plot(args.plot, results, title=" | ".join(header[:2]))
            print(f"wrote {args.plot}", file=sys.stderr)
        busiest = results[0].aggregate.client_cpu_fraction
        if busiest is not None and busiest > CLIENT_BUSY_WARNING:
            print(f"pagewire bench: warning: the load generator was busy {busiest:.0%} of a run on its busiest "
                  f"process ({args.client_processes} process(es)); it may have limited the measurement: try "
                  f"--client-processes {args.client_processes * 2}", file=sys.stderr)
        failed = sum(r.aggregate.num_failed for r in results)
        if failed:
            print(f"pagewire bench: {failed} request(s) failed; the figures count successful requests only",
                  file=sys.stderr)
            return 1
        return 0


def bench_command(args) -> int:
    """Entry point of ``pagewire bench`` (after argument parsing)."""
    try:
        validate_args(args)
        return Bench(args).run()
    except BenchError as e:
        print(f"pagewire bench: error: {e}", file=sys.stderr)
        return 2
