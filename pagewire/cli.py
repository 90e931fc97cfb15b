"""The ``pagewire`` command: serve, core, worker, scheduler, api-server, generate, bench."""

from __future__ import annotations

import argparse
import sys

from pagewire import __version__
from pagewire.cli_args import DEFAULT_LISTEN, add_connection_arguments, positive_float, positive_int, server_address
from pagewire_common import envs, eventloop
from pagewire_common.logs import LEVELS, setup_logging
from pagewire_common.settings import API, CORE, PROCESS, PUBLIC, WORKER, Settings, add_arguments
from pagewire_common.supervisor import die_with_parent

PUBLIC_TITLE = "public address: API key and TLS"
# the engine cores serve starts or joins: its own flags only (the scheduler and API servers get addresses)
DATA_PARALLEL_LAYOUT = ("data_parallel_size", "data_parallel_cores")


def _log_level(value: str) -> str:
    value = value.strip().lower()
    return "warning" if value == "warn" else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagewire",
        description="Serve large language models over gRPC: API servers (tokenize, stream) in front of a scheduler "
        "core (continuous batching, KV block allocation) in front of a worker (model, paged KV cache).",
    )
    parser.add_argument("--version", action="version", version=f"pagewire {__version__}")
    parser.add_argument("--log-level", default=envs.log_level(), type=_log_level, choices=LEVELS,
                        help="debug, info, warning or error (default: info; env PAGEWIRE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run worker, scheduler core and API servers on this machine (the usual way)",
                       description="Start the worker and the scheduler (which starts --api-servers API-server "
                       "processes on --listen; with --data-parallel-size or --data-parallel-cores, serve starts a "
                       "worker and a core per engine core and the API servers itself) as child processes, and keep "
                       "them alive: a child that dies is "
                       "restarted (calls it was serving end UNAVAILABLE), and repeated crashes stop serve. "
                       "Ctrl-C or SIGTERM stops taking requests, lets running ones finish, and stops everything.")
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help="the model, as --model takes it (`pagewire serve ORG/NAME`, as vllm serve takes it)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="public address for clients (default: %(default)s)")
    add_arguments(p, (WORKER,), title="model and KV cache (worker)")
    add_arguments(p, (CORE,), title="batching (scheduler core)", skip=("max_model_len",))
    add_arguments(p, (API, PROCESS), title="API servers and processes")
    add_arguments(p, (PUBLIC,), title=PUBLIC_TITLE)

    p = sub.add_parser("worker", help="run only the worker (model + KV cache)",
                       description="Serve the internal pagewire.v1.Worker service for one scheduler core. With "
                       "--tensor-parallel-size N it runs N ranks (it starts ranks 1..N-1 itself); with --rank R > 0 "
                       "it runs only that rank, started apart on this or another machine, which serves nothing.")
    p.add_argument("--listen", default=None,
                   help="address for the scheduler, host:port or unix:PATH (required, except for --rank R > 0)")
    add_arguments(p, (WORKER,), title="model and KV cache")

    p = sub.add_parser("scheduler", help="run the scheduler core and its API servers (public gRPC API)",
                       description="Run the scheduler core (admission, batching, KV blocks, the link to the worker "
                       "at --worker; reconnects when the worker restarts) and start --api-servers API-server "
                       "processes that serve pagewire.v1.Generation on --listen, restarting any that dies.")
    p.add_argument("--worker", dest="worker_address", required=True, metavar="ADDR",
                   help="the worker's address, host:port or unix:PATH")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="public address for clients (default: %(default)s)")
    p.add_argument("--core-listen", default=None, metavar="ADDR",
                   help="address of the core's internal SchedulerCore service, for API servers run apart with "
                   "`pagewire api-server --scheduler ADDR` (default: a private unix socket)")
    p.add_argument("--core-only", action="store_true",
                   help="start no API servers (--listen is not used): serve only the core on --core-listen, for "
                   "the API servers of `serve --data-parallel-size` or of another machine")
    add_arguments(p, (CORE,), title="batching (scheduler core)")
    add_arguments(p, (API, PROCESS), title="API servers and processes", skip=DATA_PARALLEL_LAYOUT)
    add_arguments(p, (PUBLIC,), title=PUBLIC_TITLE)

    p = sub.add_parser("api-server", help="run one API server in front of a running scheduler core",
                       description="Serve pagewire.v1.Generation on --listen: validate, tokenize, stream, in front "
                       "of the scheduler core at --scheduler (its --core-listen). The scheduler starts these itself; "
                       "run one alone to add capacity or to debug.")
    p.add_argument("--scheduler", required=True, metavar="ADDR[,ADDR...]",
                   help="the engine cores' addresses (each a scheduler's --core-listen); with several, each request "
                   "goes to one of them (--data-parallel-routing)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="public address for clients (default: %(default)s)")
    p.add_argument("--reuse-port", action="store_true",
                   help="share --listen with other API servers (SO_REUSEPORT); the scheduler passes it to its own")
    p.add_argument("--primary-cores", type=positive_int, default=None, metavar="N",
                   help="only the first N cores of --scheduler say which model is served; the others take requests "
                   "once one of those serves, and only with the same model (serve passes its local cores' count "
                   "when --data-parallel-cores names cores elsewhere) (default: any core, the first to come up)")
    add_arguments(p, (API, PROCESS), title="API server", skip=("api_servers", *DATA_PARALLEL_LAYOUT))
    add_arguments(p, (PUBLIC,), title=PUBLIC_TITLE)

    p = sub.add_parser("core", help="run an engine core (worker + scheduler core) for the API servers of another "
                       "machine", description="Start a worker and a scheduler core without API servers, the core "
                       "listening on --listen, and keep them alive as serve does. The API servers of "
                       "`pagewire serve --data-parallel-cores HOST:PORT` on another machine send requests to it; "
                       "while it is down they route around it, and it rejoins when it is back.")
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="the core's address for the API servers (its frame links take an ephemeral port of the "
                   "same host)")
    add_arguments(p, (WORKER,), title="model and KV cache (worker)")
    add_arguments(p, (CORE,), title="batching (scheduler core)", skip=("max_model_len",))
    add_arguments(p, (PROCESS,), title="processes",
                  skip=("api_servers", "http_listen", *DATA_PARALLEL_LAYOUT))

    p = sub.add_parser("generate", help="stream a completion from a running server to stdout",
                       description="Send one prompt (or, with --chat, one user message) to a running pagewire "
                       "server over gRPC and print the text as it streams; greedy unless --temperature is given. "
                       "Exit code 1 with the server's status and message when the call fails.")
    p.add_argument("prompt", help="the prompt text (or the user message with --chat)")
    p.add_argument("--addr", default=DEFAULT_LISTEN, type=server_address,
                   help="server address, HOST:PORT or unix:PATH (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the smallest set of tokens whose probability adds up to this, in (0, 1] (default: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (default: 0, off; -1 is "
                   "off too, as vLLM spells it)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling: same seed and server settings, same output (on a CPU server "
                   "busy with other requests, only with its --deterministic) (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string, cut from the output (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--show-usage", action="store_true", help="print token counts to stderr at the end")
    p.add_argument("--timeout", type=positive_float, default=None, help="deadline in seconds (default: none)")
    add_connection_arguments(p)

    from pagewire.bench.cli import add_bench_parser

    add_bench_parser(sub)
    for command in sub.choices.values():  # also after the command (`pagewire serve --log-level debug`)
        command.add_argument("--log-level", default=argparse.SUPPRESS, type=_log_level, choices=LEVELS,
                             help="debug, info, warning or error (default: info; env PAGEWIRE_LOG_LEVEL)")
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    parser = build_parser()
    args = parser.parse_args(argv)
    positional = getattr(args, "model_positional", None)
    if positional is not None:
        if args.model is not None and args.model != positional:
            parser.error(f"the model is given twice: {positional} and --model {args.model}")
        args.model = positional
    if args.log_level not in LEVELS:  # argparse checks the choices of a flag given, not of its default
        parser.error(f"PAGEWIRE_LOG_LEVEL must be one of {', '.join(LEVELS)}, got {envs.log_level()!r}")
    setup_logging(args.log_level)
    try:
        from worker_svc.cpu import features

        features.cap_torch_isa()  # PAGEWIRE_CPU_ISA: before anything imports torch
        if args.command == "worker":
            from worker_svc.server import serve

            return serve(Settings.from_args(args), args.listen)
        if args.command == "scheduler":
            from scheduler_svc.core.main import run_scheduler

            return eventloop.run(run_scheduler(args.worker_address, None if args.core_only else args.listen,
                                               Settings.from_args(args), core_listen=args.core_listen,
                                               log_level=args.log_level))
        if args.command == "api-server":
            from scheduler_svc.api.main import run_api_server

            return eventloop.run(run_api_server(args.scheduler, args.listen, Settings.from_args(args),
                                                reuse_port=args.reuse_port, primary_cores=args.primary_cores))
        if args.command == "serve":
            from pagewire.serve import serve

            return serve(Settings.from_args(args), args.listen, args.log_level)
        if args.command == "core":
            from pagewire.serve import serve_core

            return serve_core(Settings.from_args(args), args.listen, args.log_level)
        if args.command == "generate":
            from pagewire.client import generate_command

            return generate_command(args)
        if args.command == "bench":
            from pagewire.bench.cli import bench_command

            return bench_command(args)
    except KeyboardInterrupt:
        print("pagewire: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pagewire: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
