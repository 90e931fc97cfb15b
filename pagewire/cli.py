"""The ``pagewire`` command: serve, worker, scheduler, generate."""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import signal
import subprocess
import sys
import tempfile

from pagewire_common import envs, eventloop

DEFAULT_LISTEN = "127.0.0.1:50051"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _bytes_size(text: str) -> int:
    """'512M', '2G', '1073741824'."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 2G)") from None


def add_worker_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and KV cache (worker)")
    g.add_argument("--model", default=None, help="Hugging Face model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--served-model-name", default=None, help="name reported by GetModelInfo and accepted in requests (default: the model directory's name)")
    g.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="weights and KV cache dtype (default: %(default)s)")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=_positive_int, default=None, help="KV blocks to allocate (default: as many as --kv-cache-memory holds)")
    g.add_argument("--kv-cache-memory", dest="kv_cache_bytes", type=_bytes_size, default=None, help="memory for the KV cache, e.g. 2G (default: 1G on CPU, 90%% of free GPU memory)")
    g.add_argument("--max-model-len", type=_positive_int, default=None, help="longest prompt + output in tokens (default: the model's)")
    g.add_argument("--num-threads", type=_positive_int, default=None, help="CPU threads for the worker's torch ops (default: torch's, one per core)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA (default: replay graphs captured at start)")
    g.add_argument("--cuda-graph-max-batch", type=_positive_int, default=256, help="largest decode batch captured as a CUDA graph (default: %(default)s)")
    g.add_argument("--worker", choices=["model", "null"], default="model",
                   help="model: run the model (default); null: no model math, return fixed ordinary tokens using "
                   "--model's config and tokenizer only, to measure the control plane (scheduler, gRPC, streaming)")


def add_scheduler_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batching (scheduler)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=512, help="token budget of one step: prefill chunks + decodes (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=_positive_int, default=256, help="most sequences running at once (default: %(default)s)")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix cache off")
    g.add_argument("--stream-interval", type=_positive_int, default=1, help="after a request's first token, send a response once this many tokens are ready (fewer, larger messages under heavy load; default: %(default)s, every token)")
    g.add_argument("--no-overlap", action="store_true", help="wait for each step's result before sending the next plan (default: one plan in flight ahead)")
    g.add_argument("--admission-turns", type=_non_negative_int, default=32, help="after each step, let the event loop turn up to this many times while new calls keep arriving, so that a busy engine fills its batches instead of stepping once per accepted call (gRPC accepts one call at a time); 0: step at once (default: %(default)s)")
    g.add_argument("--prefill-pacing-steps", type=_non_negative_int, default=0, metavar="N", help="while sequences are decoding, let a step carry only 1/N of the prompt tokens waiting to be computed (at least 16), so that prompts arriving in bursts are spread over the next steps and streams see an even inter-token latency, at the cost of a longer time to first token; a growing backlog raises the share, and with nothing decoding prompts get the whole budget. Try 32-64 for interactive streaming with long prompts; 0: off, prompts take what the budget leaves (default: %(default)s)")
    g.add_argument("--max-queued-requests", type=int, default=1024, help="waiting requests beyond this get RESOURCE_EXHAUSTED (default: %(default)s)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to let running requests finish on SIGTERM (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagewire",
        description="Serve large language models over gRPC: a scheduler (continuous batching, "
        "KV block allocation) in front of a worker (model, paged KV cache).",
    )
    parser.add_argument("--log-level", default=envs.log_level(), help="debug, info, warning, error (default: info; env PAGEWIRE_LOG_LEVEL)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="start a worker and a scheduler on this machine (the usual way to run)",
                       description="Start the worker as a child process on a private unix socket and the "
                       "scheduler in this process; serve pagewire.v1.Generation on --listen. Ctrl-C or SIGTERM "
                       "stops taking requests, lets running ones finish, and stops both.")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="address for clients (default: %(default)s)")
    add_worker_options(p)
    add_scheduler_options(p)

    p = sub.add_parser("worker", help="run only the worker (model + KV cache)",
                       description="Serve the internal pagewire.v1.Worker service for one scheduler.")
    p.add_argument("--listen", required=True, help="address for the scheduler, host:port or unix:PATH")
    add_worker_options(p)

    p = sub.add_parser("scheduler", help="run only the scheduler (public gRPC API)",
                       description="Serve pagewire.v1.Generation, driving the worker at --worker. Reconnects "
                       "when the worker restarts.")
    p.add_argument("--worker", required=True, help="the worker's address, host:port or unix:PATH")
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="address for clients (default: %(default)s)")
    p.add_argument("--max-model-len", type=_positive_int, default=None, help="cap on prompt + output tokens (default: the worker's)")
    add_scheduler_options(p)

    p = sub.add_parser("generate", help="stream a completion from a running server to stdout")
    p.add_argument("prompt", help="the prompt text (or the user message with --chat)")
    p.add_argument("--addr", default=DEFAULT_LISTEN, help="server address (default: %(default)s)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=_positive_int, default=64, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--show-usage", action="store_true", help="print token counts to stderr at the end")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")

    from pagewire.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "worker":
            from worker_svc.server import serve

            return serve(args)
        if args.command == "scheduler":
            from scheduler_svc.main import options_from_args, run_scheduler

            return eventloop.run(run_scheduler(args.worker, args.listen, options_from_args(args), args.shutdown_timeout))
        if args.command == "serve":
            return _serve(args)
        if args.command == "generate":
            from pagewire.client import generate_command

            return generate_command(args)
        if args.command == "bench":
            from pagewire.bench.cli import bench_command

            return bench_command(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"pagewire: error: {e}", file=sys.stderr)
        return 2
    return 1


def _worker_argv(args, listen: str) -> list[str]:
    argv = [sys.executable, "-m", "pagewire.cli", "--log-level", args.log_level, "worker", "--listen", listen,
            "--dtype", args.dtype, "--block-size", str(args.block_size), "--worker", args.worker]
    if args.no_cuda_graphs:
        argv.append("--no-cuda-graphs")
    for flag, value in (
        ("--model", args.model),
        ("--served-model-name", args.served_model_name),
        ("--device", args.device),
        ("--num-kv-blocks", args.num_kv_blocks),
        ("--kv-cache-memory", args.kv_cache_bytes),
        ("--max-model-len", args.max_model_len),
        ("--cuda-graph-max-batch", args.cuda_graph_max_batch),
        ("--num-threads", args.num_threads),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def _serve(args) -> int:
    from scheduler_svc.main import options_from_args, run_scheduler

    sock_dir = tempfile.mkdtemp(prefix="pagewire-")
    worker_addr = f"unix:{sock_dir}/worker.sock"
    if args.model is None:
        print("pagewire: serving the embedded SmolLM2-135M-Instruct (first start converts it once, ~20 s)", flush=True)
    print(f"pagewire: starting the worker on {worker_addr}", flush=True)
    # the worker gets its own process group so a terminal's Ctrl-C reaches it only through us
    worker = subprocess.Popen(_worker_argv(args, worker_addr), start_new_session=True)

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        async def watch_worker():
            while worker.poll() is None:
                await asyncio.sleep(0.2)
            if not stop.is_set():
                print(f"pagewire: the worker exited with code {worker.returncode}; stopping", file=sys.stderr, flush=True)
                stop.set()

        watcher = asyncio.create_task(watch_worker())
        code = await run_scheduler(
            worker_addr, args.listen, options_from_args(args), args.shutdown_timeout,
            ready_message=f"pagewire ready: serving on {args.listen}",
            stop_event=stop,
        )
        watcher.cancel()
        return code

    try:
        code = eventloop.run(run())
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        shutil.rmtree(sock_dir, ignore_errors=True)
    print("pagewire: stopped", flush=True)
    if worker.returncode not in (0, -signal.SIGTERM):
        return code or 1  # the worker died on its own
    return code


if __name__ == "__main__":
    sys.exit(main())
