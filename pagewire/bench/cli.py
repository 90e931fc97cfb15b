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
import os
import sys
import tempfile

from pagewire.bench.sampling_mix import help_text as mix_help, parse_mixes
from pagewire.bench.server import BenchError, passthrough_flags
from pagewire.cli_args import (DEFAULT_LISTEN, add_connection_arguments, non_negative_float, non_negative_int,
                               positive_float, positive_int, server_address)
from pagewire_common.settings import API, CORE, PROCESS, WORKER, add_arguments

BASELINE_NAMES = ("hf", "hf-cb")
DEFAULT_CONCURRENCY = 64
DEFAULT_PROMPT_LEN = "128"

EXAMPLES = """\
examples:
  # start a server on the embedded SmolLM2, measure it, compare with transformers
  pagewire bench --serve --num-requests 64 --concurrency 16 --max-new-tokens 64 --ignore-eos --baseline hf,hf-cb

  # the control-plane ceiling: a worker that does no math
  pagewire bench --serve --worker null --num-requests 512 --concurrency 256 --max-new-tokens 64 --ignore-eos --prompt-len 16

  # a server that is already running; Poisson arrivals at 20 req/s, mixed prompt lengths
  pagewire bench --addr 127.0.0.1:50051 --request-rate 20 --prompt-len 16-512 --json out.json --plot out.png

  # what penalties and JSON schemas cost per step: the same workload three times, half the requests
  # with the feature in the 2nd and 3rd columns
  pagewire bench --serve --num-requests 64 --concurrency 32 --max-new-tokens 64 --ignore-eos \\
      --sampling-mix greedy,penalties,json_schema

  # shared prefixes: 8 prefixes of 512 tokens, each request one of them + 128 tokens of its own;
  # the summary gives the server's prefix-cache hit rate and the ideal one
  pagewire bench --serve --prefix-groups 8 --prefix-len 512 --prompt-len 128 --num-requests 256

  # prefix-cache workload: the same text, alone and repeated 4 times
  pagewire bench --serve --prompt "The history of the lighthouse. " --prompt-repeats 1,4 --no-prefix-cache

metrics (all measured at the client with time.perf_counter):
  TTFT  send -> first token          TPOT  (last token - first token) / (n - 1), requests with n >= 2
  ITL   every gap between token arrivals, pooled (k tokens in one response: one arrival + k-1 zero gaps)
  E2E   send -> last response        throughput: completion and prompt+completion tokens/s, requests/s over wall time
  percentiles: linear interpolation between closest ranks (numpy's default); ratios > 1 mean pagewire is better.
"""


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


BACKENDS = ("grpc", "openai")


def _backends(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BACKENDS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give one or more of {', '.join(BACKENDS)}, comma-separated, got {text!r}")
    return names


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand to ``pagewire``'s subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="measure a server's throughput and latency at the client (optionally vs transformers)",
        description="Send a workload to a pagewire server over gRPC (or its OpenAI door: --backend openai; asyncio "
        "clients, many streams each, in --client-processes processes) and report "
        "TTFT, TPOT, ITL, end-to-end latency and throughput measured at the client. The server is the one at --addr, "
        "or one started for the bench with --serve. --baseline runs Hugging Face transformers on the same prompts "
        "in this process for comparison.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--addr", default=None, type=server_address,
                   help=f"the server to measure (default: {DEFAULT_LISTEN}); with --serve, where the started server "
                   "listens (default then: a free port on 127.0.0.1)")
    g.add_argument("--serve", action="store_true",
                   help="start `pagewire serve` as a child process with the engine options below, wait for "
                   "'pagewire ready', and stop it (SIGTERM) at the end")
    g.add_argument("--backend", type=_backends, default=["grpc"], metavar="grpc|openai[,...]",
                   help="the door to measure: grpc (pagewire.v1.Generation), openai (streamed POST /v1/completions "
                   "on the server's --http-listen address), or both, e.g. grpc,openai: each run is then sent "
                   "through each door in turn and the table shows them side by side (default: grpc)")
    g.add_argument("--connect-timeout", type=positive_float, default=10.0,
                   help="seconds to wait for the server at --addr to answer (default: %(default)s)")
    g.add_argument("--serve-timeout", type=positive_float, default=600.0,
                   help="seconds to wait for a --serve server to be ready (the first start of the embedded model "
                   "converts it once) (default: %(default)s)")
    g.add_argument("--server-log", default=None, metavar="PATH",
                   help="with --serve, write the server's output to PATH (default: kept in memory and shown only "
                   "if it fails)")

    add_connection_arguments(p)

    g = p.add_argument_group("engine (passed to the server with --serve; used by the baselines)")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory, .gguf file or Hugging Face id ORG/NAME (default: the embedded "
                   "SmolLM2-135M-Instruct). "
                   "Without --serve it names the local copy of the served model, used for its tokenizer's special "
                   "tokens and by the baselines")
    # every other engine setting of `pagewire serve`, declared once in pagewire_common.settings; unset
    # means the server's own default
    add_arguments(p, (WORKER, CORE, API, PROCESS), title="engine settings of `pagewire serve` (with --serve; "
                  "the baselines follow dtype, device, block size, batch limits and the prefix cache)",
                  unset_defaults=True, skip=("model", "served_model_name", "shutdown_timeout"))

    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=positive_int, default=256, help="requests per run (default: %(default)s)")
    g.add_argument("--concurrency", type=positive_int, default=None,
                   help=f"closed loop: keep this many requests in flight (default: {DEFAULT_CONCURRENCY} unless "
                   "--request-rate is given)")
    g.add_argument("--request-rate", type=positive_float, default=None,
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
    g.add_argument("--prefix-groups", type=positive_int, default=None, metavar="G",
                   help="shared-prefix workload (with --prefix-len): each run draws G prefixes of random token ids "
                   "(from --seed), request i sends prefix i %% G (round robin) followed by its own distinct suffix "
                   "of --prompt-len random ids; the summary gives the server's prefix-cache hit rate beside the "
                   "ideal one for the workload")
    g.add_argument("--prefix-len", type=positive_int, default=None, metavar="L",
                   help="tokens of each --prefix-groups prefix")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens to generate per request "
                   "(default: %(default)s)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate exactly --max-new-tokens tokens (keep going past EOS), so every engine produces "
                   "the same number of tokens")
    g.add_argument("--temperature", type=non_negative_float, default=0.0,
                   help="0 is greedy; > 0 samples with top-k/top-p off (default: %(default)s)")
    g.add_argument("--sampling-mix", type=parse_mixes, default=["greedy"], metavar="MIX[,MIX]", help=mix_help())
    g.add_argument("--warmup-runs", type=non_negative_int, default=1,
                   help="runs of the same shape before measuring, not reported (default: %(default)s)")
    g.add_argument("--repeat-runs", type=positive_int, default=1,
                   help="measured runs; the summary pools them (default: %(default)s)")
    g.add_argument("--client-processes", type=positive_int, default=None, metavar="N",
                   help="load-generator processes sharing the streams (each one asyncio loop and one gRPC channel); "
                   "one Python process handles some tens of thousands of streamed messages/s, so raise this when "
                   "the summary says the client was busy (default: 1, or concurrency/64 up to cpus/4 and 4; 1 with "
                   "--backend openai)")
    g.add_argument("--connections", type=positive_int, default=8, metavar="N",
                   help="TCP connections the client spreads its streams over (split between client processes); "
                   "the kernel hands each connection to one of the server's API servers, so fewer connections "
                   "than API servers leaves some idle (default: %(default)s)")
    g.add_argument("--request-timeout", type=positive_float, default=None,
                   help="deadline of each request in seconds; one that passes it counts as failed (default: none)")

    g = p.add_argument_group("baselines (Hugging Face transformers, in this process, same model and prompts)")
    g.add_argument("--baseline", action="append", default=[], metavar="NAME[,NAME]",
                   help="hf: model.generate on static batches (left padding; only throughput and per-batch "
                   "latency are observable); hf-cb: transformers' continuous batching (per-token times). "
                   "Repeatable or comma-separated")
    g.add_argument("--baseline-batch-size", type=positive_int, default=None,
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
    if (args.prefix_groups is None) != (args.prefix_len is None):
        raise BenchError("--prefix-groups and --prefix-len go together: give both (G prefixes of L tokens each)")
    if args.prefix_groups is not None and args.prompt is not None:
        raise BenchError("--prefix-groups builds random token ids: give --prompt-len for the suffixes, not --prompt")
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
        args.client_processes = 1 if "openai" in args.backend else max(1, min(4, streams // 64, (os.cpu_count() or 1) // 4))
    if len(args.backend) * len(args.sampling_mix) > 1 and args.enable_prefix_caching is not False:
        # every column of a run sends the run's prompts: the later columns find them cached
        print("pagewire bench: note: each column of a run sends the same prompts, so with the prefix cache on the "
              "later columns find them cached (lower TTFT, higher throughput); add --no-prefix-cache to compare "
              "columns", file=sys.stderr)
    if "openai" in args.backend and args.client_processes > 1:
        raise BenchError("--backend openai runs its client in this process: use --client-processes 1")
    if args.concurrency is not None and args.client_processes > args.concurrency:
        raise BenchError(f"--client-processes ({args.client_processes}) is more than --concurrency ({args.concurrency})")
    if args.baseline_batch_size is None:
        args.baseline_batch_size = args.concurrency or 32
    for flag, path in (("--json", args.json), ("--plot", getattr(args, "plot", None))):
        if path is not None:
            check_writable(flag, path)
    if args.plot is not None:
        from pagewire.bench.report import require_matplotlib

        try:
            require_matplotlib()
        except ImportError as e:
            raise BenchError(str(e)) from None
    if not args.serve:
        # the baselines follow what the running server reports (dtype, block size, KV blocks)
        # the settings the baselines also use (model, device, batch limits, prefix cache) are not server-only
        # (and --http-listen, where the openai backend finds the running server's HTTP door)
        also_baselines = ("model", "device", "max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching",
                          "http_listen")
        server_only = [flag for flag, dest in passthrough_flags()
                       if dest not in also_baselines and getattr(args, dest) is not None]
        if server_only:
            print(f"pagewire bench: note: {', '.join(server_only)} only configure a server started with --serve; "
                  f"the server at {args.addr or DEFAULT_LISTEN} keeps its own settings", file=sys.stderr)


def check_writable(flag: str, path: str) -> None:
    """Refuse an output file that cannot be written before the run, not after it (its folders are
    made when missing)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        if os.path.exists(folder):
            raise BenchError(f"{flag} {path}: {folder} is not a folder")
        folder = os.path.dirname(folder)
    if os.path.isdir(path):
        raise BenchError(f"{flag} {path}: it is a folder")
    try:  # a file made and removed: permissions alone say nothing to root, or of /proc
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".pagewire-bench-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise BenchError(f"{flag} {path}: cannot write in {folder}: {e.strerror}") from None


def bench_command(args) -> int:
    """Entry point of ``pagewire bench`` (after argument parsing)."""
    from pagewire.bench.session import Bench  # grpc, torch and friends load only for a real run

    try:
        validate_args(args)
        return Bench(args).run()
    except BenchError as e:
        print(f"pagewire bench: error: {e}", file=sys.stderr)
        return 2
