"""One ``pagewire bench`` invocation: serve (optionally), connect, run warmups and measured runs,
run the baselines, report."""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
from pathlib import Path

from pagewire_common import eventloop
from pagewire.bench.server import (
    passthrough_flags,
    BenchError,
    ServedServer,
    free_port,
    _serve_defaults,
    check_can_listen,
    serve_argv,
)
from pagewire.bench.report import OURS, cpu_info, isa_text
from pagewire.cli_args import DEFAULT_LISTEN

# warn when the busiest client process used more than this share of a core
CLIENT_BUSY_WARNING = 0.8


class LineProgress:
    """A run's progress as lines for a log: at the start, every ``every_s`` seconds and at the end."""

    def __init__(self, label: str, total: int, every_s: float = 30.0):
        self.label, self.total, self.every_s = label, total, every_s
        self.done = 0
        self.start = time.monotonic()
        self.next = self.start + every_s
        print(f"{label}: {total} requests", file=sys.stderr, flush=True)

    def update(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.every_s
            self._line(now)

    def _line(self, now: float) -> None:
        print(f"{self.label}: {self.done}/{self.total} requests done, {now - self.start:.0f} s", file=sys.stderr,
              flush=True)

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, *exc) -> None:
        self._line(time.monotonic())


class Bench:
    def __init__(self, args):
        self.args = args
        self.baselines: list[str] = args.baselines
        self.defaults = _serve_defaults()
        self.model_dir: Path | None = None
        self.tokenizer = None  # scheduler_svc.api.tokenizer.Tokenizer of the local model copy, if any
        self.model_info = None
        self.run_prompts: list[list] = []  # per run index (warmups first): token-id lists or texts
        self.run_offsets: list[list[float] | None] = []
        # with --serve: the served server's processes by role (pagewire.bench.procs.serve_roles), and
        # per (backend, mix) column the CPU seconds each role spent in each measured run
        self.server_roles: dict[str, list[int]] | None = None
        self.server_cpu: dict[tuple[str, str], list[dict[str, float]]] = {}
        # per column the growth of the server's prefix-cache counters over each measured run, or why
        # they could not be read (a str)
        self.prefix_cache: dict[tuple[str, str], list | str] = {}

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
        """A bar on a terminal; into a log file (stderr not a terminal), a line now and then."""
        if not self.args.no_progress and not sys.stderr.isatty():
            return LineProgress(label, self.args.num_requests)
        from tqdm import tqdm

        return tqdm(total=self.args.num_requests, desc=label, unit="req", file=sys.stderr, leave=False,
                    disable=True if self.args.no_progress else None, dynamic_ncols=True)

    # ---- setup ---------------------------------------------------------------------------------

    def resolve_local_model(self) -> None:
        """The local copy of the model: for --serve, baselines, or when --model is given."""
        args = self.args
        if not (args.serve or self.baselines or args.model is not None):
            return
        from scheduler_svc.api.tokenizer import Tokenizer

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
        from pagewire.bench.prefix_cache import prefix_group_prompts

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
            if args.prefix_groups is not None:
                self._check_length(args.prefix_len + args.prompt_len[1])
                allowed = [t for t in range(vocab) if t not in excluded]
                try:
                    self.run_prompts = [
                        prefix_group_prompts(n, args.prefix_groups, args.prefix_len, args.prompt_len, allowed,
                                             run_rng(args.seed, i, "prefix-groups"))
                        for i in range(self.num_runs)
                    ]
                except ValueError as e:
                    raise BenchError(str(e)) from None
            else:
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

    async def run_ours(self, addr: str) -> dict[str, list]:
        """Connect, build the workload, run warmups and measured runs through each door of
        ``--backend`` (in turn within each run); the measured runs' LoadResults by door."""
        from pagewire.bench.http_client import HttpClient
        from pagewire.bench.loadgen import Client, ClientPool, ServerUnreachable, build_requests
        from pagewire.bench.procs import cpu_by_role
        from pagewire.bench.sampling_mix import apply_mix
        from pagewire.client import ServerAccess, make_sampling

        args = self.args
        access = ServerAccess.from_args(args)
        client = Client(addr, args.connections, access)
        http = HttpClient(self.http_url(), access=access) if "openai" in args.backend else None
        pool = None
        try:
            try:
                self.model_info = await client.wait_ready(args.connect_timeout)
                if http is not None:
                    await http.wait_ready(args.connect_timeout)
                if args.client_processes > 1:
                    pool = await asyncio.get_running_loop().run_in_executor(
                        None, ClientPool, addr, args.client_processes, 60.0,
                        max(1, args.connections // args.client_processes), access,
                    )
            except ServerUnreachable as e:
                raise BenchError(str(e)) from None
            self.check_model_matches()
            self.build_workload()
            sampling = make_sampling(max_tokens=args.max_new_tokens, temperature=args.temperature,
                                     ignore_eos=args.ignore_eos)
            runner = pool or client
            columns = [(backend, mix) for backend in args.backend for mix in args.sampling_mix]
            measured: dict[tuple[str, str], list] = {column: [] for column in columns}
            self.server_cpu = {column: [] for column in columns}
            self.prefix_cache = {column: [] for column in columns}
            for i in range(self.num_runs):
                plain = build_requests(self.run_prompts[i], sampling)
                for backend, mix in columns:
                    requests = plain if mix == "greedy" else apply_mix(plain, mix)
                    label = self.run_label(self.engine_name(backend, mix), i)
                    measure_cpu = self.server_roles is not None and i >= args.warmup_runs
                    cpu_before = cpu_by_role(self.server_roles) if measure_cpu else None
                    cache_before = await self.read_prefix_cache(client, backend, mix) if i >= args.warmup_runs else None
                    with self.progress(label) as bar:
                        common = dict(concurrency=args.concurrency, arrival_offsets=self.run_offsets[i],
                                      request_timeout=args.request_timeout, progress=bar)
                        if backend == "openai":
                            result = await http.run(requests, model=self.model_info.model_name, **common)
                        else:
                            result = await runner.run(requests, **common)
                    if measure_cpu:
                        # a process that exited in between reads 0 at the end: it counts up to its last reading
                        cpu_after = cpu_by_role(self.server_roles)
                        self.server_cpu[backend, mix].append(
                            {role: max(0.0, cpu_after[role] - cpu_before[role]) for role in self.server_roles})
                    self.log_run(label, result.records, result.duration_s, result.client_cpu_fraction)
                    if i >= args.warmup_runs:
                        measured[backend, mix].append(result)
                        cache_after = await self.read_prefix_cache(client, backend, mix)
                        if cache_before is not None and cache_after is not None:
                            self.prefix_cache[backend, mix].append(cache_after.since(cache_before))
            return measured
        finally:
            if pool is not None:
                pool.close()
            if http is not None:
                await http.close()
            await client.close()

    async def read_prefix_cache(self, client, backend: str, mix: str):
        """The server's prefix-cache counters now (a PrefixCacheCounts), or None, the column's
        entry then saying why, once they cannot be read."""
        import grpc

        from pagewire.bench.prefix_cache import PrefixCacheCounts

        if isinstance(self.prefix_cache[backend, mix], str):
            return None
        try:
            stats = await client.get_stats(self.args.connect_timeout)
        except grpc.aio.AioRpcError as e:
            self.prefix_cache[backend, mix] = (f"GetStats over gRPC at {client.addr} failed: "
                                               f"{e.code().name}: {e.details()}")
            return None
        return PrefixCacheCounts(stats.num_prefix_cache_queried_tokens, stats.num_prefix_cache_hit_tokens)

    def prefix_cache_dict(self) -> dict:
        """The JSON's ``prefix_cache`` (schema in pagewire.bench.report)."""
        from pagewire.bench.prefix_cache import ideal_hit_rate, prefix_cache_dict

        args = self.args
        ideal = None
        if args.prefix_groups is not None:
            block_size = self.model_info.block_size or self.option("block_size")
            ideal = ideal_hit_rate([[len(p) for p in prompts] for prompts in self.run_prompts[args.warmup_runs:]],
                                   args.prefix_groups, args.prefix_len, block_size)
        engines = {}
        for column, runs in self.prefix_cache.items():
            engines[self.engine_name(*column)] = ({"known": False, "reason": runs} if isinstance(runs, str)
                                                  else prefix_cache_dict(runs))
        return {"ideal_hit_rate": ideal, "engines": engines}

    def engine_name(self, backend: str, mix: str) -> str:
        """The table's name for a door and a sampling mix: ours is the first of each given."""
        name = OURS if backend == self.args.backend[0] else f"{OURS}-{backend}"
        return name if mix == self.args.sampling_mix[0] else f"{name}-{mix}"

    def http_url(self) -> str:
        from pagewire_common.settings import default_of

        from pagewire.client import ServerAccess

        scheme = "https://" if ServerAccess.from_args(self.args).uses_tls else "http://"
        return scheme + (self.args.http_listen or default_of("http_listen"))

    def check_model_matches(self) -> None:
        info = self.model_info
        if not self.baselines or self.model_dir is None:
            return
        from worker_svc.weights import model_name  # the baselines import torch anyway

        if info.model_name != model_name(self.args.model, self.model_dir):
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
            prefix_cache=self.option("enable_prefix_caching"),
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
                # what the installed transformers took of our settings, and what it has no place for
                setup = hf.last_cb_setup
                details["continuous_batching_config"] = setup.applied
                details["continuous_batching_unsupported"] = setup.unsupported
                if setup.unsupported:
                    print(f"pagewire bench: note: hf-cb ran without {', '.join(setup.unsupported)}: the installed "
                          f"transformers' continuous batching has no such setting", file=sys.stderr)
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
            if args.prefix_groups is not None:
                prompt = (f"one of {args.prefix_groups} prefixes of {args.prefix_len} random tokens (round robin) "
                          f"+ {prompt} of its own")
        sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
        if args.sampling_mix != ["greedy"]:
            sampling += "; sampling mixes (every other request): " + ", ".join(args.sampling_mix)
        eos = ", ignore EOS" if args.ignore_eos else ""
        worker = " [null worker: no model math]" if args.worker == "null" else ""
        cpu = cpu_info()
        return [
            f"pagewire bench: {args.num_requests} requests x {args.repeat_runs} run(s) (+{args.warmup_runs} warmup), "
            f"{mode}",
            f"prompt: {prompt}; up to {args.max_new_tokens} new tokens{eos}; {sampling}",
            f"server: {addr}{' (started by the bench)' if args.serve else ''}: {info.model_name}, {info.dtype} on "
            f"{info.device}, {info.num_kv_blocks} KV blocks x {info.block_size}{worker}",
            f"this machine: {cpu['cpu_model'] or 'CPU model unknown'}, {cpu['cpu_cores_usable']} cores, "
            f"ISA {isa_text(cpu)}",
        ]

    def config_dict(self) -> dict:
        args = self.args
        keys = ("num_requests", "concurrency", "request_rate", "seed", "prompt_len", "prompt", "prompt_repeats",
                "max_new_tokens", "ignore_eos", "temperature", "warmup_runs", "repeat_runs", "request_timeout",
                "baselines", "baseline_batch_size", "serve", "worker", "client_processes", "connections",
                "sampling_mix", "prefix_groups", "prefix_len")
        out = {k: getattr(args, k) for k in keys}
        out["prompt_len"] = list(args.prompt_len) if args.prompt_len else None
        out["worker"] = args.worker or "model"
        # the engine settings the bench started its server with; a server it did not start says what
        # it serves in "server"
        if args.serve:
            out["engine"] = {dest: self.option(dest) for _flag, dest in passthrough_flags() if dest != "worker"}
            out["engine"]["model"] = str(self.model_dir) if self.model_dir else args.model
        else:
            out["engine"] = None
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

    def server_cpu_dict(self, measured: dict[tuple[str, str], list]) -> dict:
        """The JSON's ``server_cpu`` (schema in pagewire.bench.report): the served server's CPU by
        role over each measured run of each of our columns, or that it is not known."""
        from pagewire.bench.procs import RoleCpu

        if self.server_roles is None:
            return {"known": False, "reason": "the bench did not start the server (no --serve), so it does not know "
                                              "its processes"}
        engines = {}
        for column, runs in measured.items():
            per_run = self.server_cpu[column]
            # every token the client received, failed requests' too: the server spent CPU on them
            tokens = [sum(rec.completion_tokens for rec in m.records) for m in runs]
            engines[self.engine_name(*column)] = {
                "runs": [{role: RoleCpu.of(cpu_s, n, m.duration_s).to_dict() for role, cpu_s in cpu.items()}
                         for cpu, n, m in zip(per_run, tokens, runs)],
                "aggregate": {role: RoleCpu.of(sum(cpu[role] for cpu in per_run), sum(tokens),
                                               sum(m.duration_s for m in runs)).to_dict()
                              for role in self.server_roles},
            }
        return {"known": True, "pids": self.server_roles, "engines": engines}

    # ---- main ----------------------------------------------------------------------------------

    def run(self) -> int:
        from pagewire.bench.metrics import pooled_metrics, run_metrics
        from pagewire.bench.report import EngineResult, environment, json_document, summary_text, write_json, write_plot

        args = self.args
        server = None
        if args.serve:
            addr = args.addr or f"127.0.0.1:{free_port()}"
            check_can_listen(addr)
            if args.http_listen is None:  # the OpenAI door on a free port too, never the shared default
                args.http_listen = f"127.0.0.1:{free_port()}"
            server = ServedServer(serve_argv(args, addr), addr, args.server_log)
        else:
            addr = args.addr or DEFAULT_LISTEN
        self.resolve_local_model()
        if server is not None:
            print(f"pagewire bench: starting `pagewire serve` on {addr}...", file=sys.stderr, flush=True)
        try:
            if server is not None:
                from pagewire.bench.procs import serve_roles

                server.start(args.serve_timeout)
                # ready means every process is up: the worker's ranks, the API servers and their helpers
                self.server_roles = serve_roles(server.proc.pid)
            measured = eventloop.run(self.run_ours(addr))
        finally:
            if server is not None:
                code = server.stop()
                if code not in (0, None):
                    print(f"pagewire bench: the server exited with code {code}; its last output:\n"
                          f"{server.output_tail()}", file=sys.stderr)
        results = []
        for (backend, mix), runs in measured.items():
            cpu = [m.client_cpu_fraction for m in runs]
            results.append(EngineResult(
                name=self.engine_name(backend, mix),
                runs=[run_metrics(m.records, m.duration_s, client_cpu_fraction=m.client_cpu_fraction) for m in runs],
                aggregate=pooled_metrics([(m.records, m.duration_s) for m in runs], client_cpu_fractions=cpu),
                records=[rec for m in runs for rec in m.records],
                details={"addr": self.http_url() if backend == "openai" else addr, "backend": backend,
                         "sampling_mix": mix, "client_processes": args.client_processes},
            ))
        if self.baselines:
            results += self.run_baselines()
            ours_tokens = results[0].aggregate.completion_tokens
            for r in results[1:]:
                if r.aggregate.completion_tokens != ours_tokens:
                    print(f"pagewire bench: note: {r.name} produced {r.aggregate.completion_tokens} completion tokens, "
                          f"pagewire {ours_tokens}{'' if args.ignore_eos else ' (use --ignore-eos to equalise)'}",
                          file=sys.stderr)
        header = self.header(addr)
        server_cpu = self.server_cpu_dict(measured)
        prefix_cache = self.prefix_cache_dict()
        sys.stdout.write(summary_text(results, header, server_cpu, prefix_cache))
        sys.stdout.flush()
        if args.json:
            doc = json_document(
                results, argv=list(sys.argv), command_line=shlex.join(sys.argv), config=self.config_dict(),
                server=self.server_dict(addr), server_cpu=server_cpu, prefix_cache=prefix_cache, env=environment(),
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
