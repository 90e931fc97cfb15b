"""Every engine and service setting, declared once: name, type, default, help and validation.

``Settings`` is the one declaration. Everything else is derived from it:
- the command-line flags of every command (``add_arguments`` with the scopes the command runs),
- ``pagewire.LLM``'s keyword arguments (``Settings(**kwargs)``),
- the flags ``serve`` and the scheduler pass to the processes they start (``to_argv``) and the
  bench's pass-through to ``serve``,
- the per-process configs (``RunnerConfig``, ``SchedulerConfig``), whose
  defaults and checks are these (``default_of``, ``check``).

A scope says which process a setting configures: ``WORKER`` (model, KV cache), ``CORE``
(batching, admission), ``API`` (how each API server serves its clients), ``PROCESS`` (process
layout and lifetime), ``PUBLIC`` (how the public address admits clients: API key, TLS; the API
servers apply it). Adding a setting is one field here and its use.

A setting with an ``env`` takes its default from that environment variable. A ``secret`` one
(the API key) never travels on a child's command line, where every user of the machine can
read it: ``to_env`` hands it over in the child's environment instead.
Torch-free: every layer imports this.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from pagewire_common import envs

WORKER = "worker"
CORE = "core"
API = "api"
PROCESS = "process"
PUBLIC = "public"
ALL_SCOPES = (WORKER, CORE, API, PROCESS, PUBLIC)
DTYPES = ("auto", "float32", "float16", "bfloat16")
WORKER_KINDS = ("model", "null")
QUANTIZATIONS = ("none", "int8")
GGUF_WEIGHTS = ("auto", "quantized", "dequantize")
LAUNCH_AHEAD = ("auto", "on", "off")
ROUTINGS = ("cache-aware", "round-robin", "least-loaded")


def parse_bytes_size(text: str) -> int:
    """'512M', '2G', '1073741824' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = str(text).strip().lower().removesuffix("b").removesuffix("i")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 512M, 2G)") from None


# ---- checks: each returns None when the value is fine, else what is wrong --------------------


def _at_least(low: int | float) -> Callable[[Any], str | None]:
    def check(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:  # NaN too
            return f"must be a number >= {low}, got {value!r}"
        return None

    return check


def _between(low: int, high: int) -> Callable[[Any], str | None]:
    def check(value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            return f"must be an integer from {low} to {high}, got {value!r}"
        return None

    return check


def _one_of(choices: tuple[str, ...]) -> Callable[[Any], str | None]:
    def check(value):
        return None if value in choices else f"must be one of {', '.join(choices)}, got {value!r}"

    return check


def _power_of_two(value) -> str | None:
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        return f"must be a power of two >= 1, got {value!r}"
    return None


def _http_address(value) -> str | None:
    if value == "off":
        return None
    host, sep, port = str(value).rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"must be host:port or off, got {value!r}"
    return None


def check_host_port(value) -> str | None:
    """None for ``host:port`` (an optional ``tcp://`` before it), else what is wrong."""
    if value is None:
        return None
    host, sep, port = str(value).removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        return f"must be host:port, got {value!r}"
    return None


def _core_addresses(value) -> str | None:
    if value is None:
        return None
    for address in str(value).split(","):
        if check_host_port(address.strip()) is not None:
            return f"must be HOST:PORT[,HOST:PORT...], got {value!r} ({address.strip()!r} is not host:port)"
    return None


def _device(value) -> str | None:
    if value is None or value in ("cpu", "cuda"):
        return None
    kind, _, index = str(value).partition(":")
    if kind == "cuda" and index.isdigit():
        return None
    return f"must be cpu, cuda or cuda:N, got {value!r}"


def _boolean(value) -> str | None:
    return None if isinstance(value, bool) else f"must be True or False, got {value!r}"


def _non_empty(value) -> str | None:
    return None if value is None or (isinstance(value, str) and value.strip()) else "must not be empty"


def _chat_template(value) -> str | None:
    if value is None:
        return None
    from pagewire_common.chat_template import load_chat_template  # jinja2 only where one is given

    try:
        load_chat_template(str(value))
    except ValueError as e:
        return str(e)
    return None


def _setting(default, help: str, *, scope: tuple[str, ...], check=None, type=None, flag=None,
             negate: str | None = None, metavar=None, choices=None, env: str | None = None, secret: bool = False):
    """One setting. ``negate`` names the flag that turns a default-True bool off
    (``--no-prefix-cache``), and a default-False bool's bare flag turns it on (``--deterministic``);
    ``type`` parses the flag's text; ``env`` names the environment variable that gives the flag its
    default; a ``secret`` is kept out of command lines and reprs. A bool setting takes only True or
    False."""
    if isinstance(default, bool) and check is None:
        check = _boolean
    return field(default=default, repr=not secret, metadata=dict(
        help=help, scope=scope, check=check, type=type, flag=flag, negate=negate, metavar=metavar,
        choices=choices, env=env, secret=secret,
    ))


@dataclass(frozen=True, slots=True)
class Settings:
    """All settings of a pagewire deployment, validated once on construction (``ValueError``
    naming the flag)."""

    # ---- worker: model and KV cache --------------------------------------------------------
    model: str | None = _setting(
        None, "a Hugging Face model directory, a .gguf file, or a Hugging Face id ORG/NAME (from the Hugging Face "
        "cache, else downloaded; HF_HUB_OFFLINE=1 never downloads) (default: the embedded SmolLM2-135M-Instruct)",
        scope=(WORKER,))
    served_model_name: str | None = _setting(
        None, "name reported by GetModelInfo and accepted in requests (default: the model's name)",
        scope=(WORKER,), check=_non_empty)
    dtype: str = _setting(
        "auto", "weights and KV cache dtype; auto: on CUDA the checkpoint's bfloat16 or float16 (a float32 "
        "checkpoint runs in bfloat16, float16 on GPUs without bf16), on CPU bfloat16 where the CPU computes it "
        "natively (avx512_bf16 or amx_bf16), else float32; the worker logs its pick; the environment variable "
        "PAGEWIRE_DTYPE changes the default (default: %(default)s)",
        scope=(WORKER,), check=_one_of(DTYPES), choices=DTYPES, env=envs.DTYPE_ENV)
    device: str | None = _setting(
        None, "torch device: cpu, cuda or cuda:N (default: cuda if available, else cpu)", scope=(WORKER,),
        check=_device, type=str)
    block_size: int = _setting(
        16, "tokens per KV block, a power of two (default: %(default)s)", scope=(WORKER,),
        check=_power_of_two, type=int)
    num_kv_blocks: int | None = _setting(
        None, "KV blocks to allocate (default: as many as --kv-cache-memory holds)", scope=(WORKER,),
        check=_at_least(1), type=int)
    kv_cache_bytes: int | None = _setting(
        None, "memory for the KV cache, e.g. 2G (default: 1G on CPU, 90%% of free GPU memory)",
        scope=(WORKER,), check=_at_least(1), type=parse_bytes_size, flag="--kv-cache-memory", metavar="SIZE")
    max_model_len: int | None = _setting(
        None, "longest prompt + output in tokens (default: the model's)", scope=(WORKER, CORE),
        check=_at_least(2), type=int)
    num_threads: int | None = _setting(
        None, "CPU threads for the worker's torch ops and CPU kernels (default: one per core, shared out among "
        "the ranks of --tensor-parallel-size and the workers of --data-parallel-size on CPU)", scope=(WORKER,),
        check=_at_least(1), type=int)
    cuda_graphs: bool = _setting(
        True, "run decode steps eagerly on CUDA (default: replay graphs captured at start)", scope=(WORKER,),
        negate="--no-cuda-graphs")
    cuda_graph_max_batch: int = _setting(
        256, "largest decode batch captured as a CUDA graph (default: %(default)s)", scope=(WORKER,),
        check=_at_least(1), type=int)
    launch_ahead: str = _setting(
        "auto", "launch each step before the previous step's sampled tokens reach the host (the step takes its "
        "input ids from the device), so the host prepares step N+1 while the GPU runs step N; a step of "
        "structured output waits for its tokens; auto: on CUDA with one rank; on: also on CPU, where it gains "
        "nothing; off: every step waits for its tokens; the environment variable PAGEWIRE_LAUNCH_AHEAD changes the "
        "default (default: %(default)s)", scope=(WORKER,), check=_one_of(LAUNCH_AHEAD), choices=LAUNCH_AHEAD,
        env=envs.LAUNCH_AHEAD_ENV)
    tensor_parallel_size: int = _setting(
        1, "shard the model over N worker ranks, one process each (one GPU each on CUDA), joined with "
        "torch.distributed (gloo on CPU, NCCL on CUDA); rank 0 serves the scheduler and starts the other ranks "
        "on this machine unless --rank is given (default: %(default)s)", scope=(WORKER,), check=_at_least(1),
        type=int, metavar="N")
    distributed_init: str | None = _setting(
        None, "host:port of the TCP store that joins the ranks, served by rank 0 (default: a free loopback port, "
        "all ranks on this machine)", scope=(WORKER,), check=check_host_port, type=str, metavar="ADDR")
    rank: int | None = _setting(
        None, "run only this rank of --world-size ranks started apart (several machines), joined at "
        "--distributed-init; rank 0 serves the scheduler (default: rank 0, which starts the others itself)",
        scope=(WORKER,), check=_at_least(0), type=int)
    world_size: int | None = _setting(
        None, "how many ranks there are in all, with --rank (equals --tensor-parallel-size, which it sets "
        "when that is left at 1)", scope=(WORKER,), check=_at_least(1), type=int, metavar="N")
    deterministic: bool = _setting(
        False, "make a request's tokens independent of its batch and of prefix-cache hits on CPU: every attention "
        "chunk on the C kernel, every unrestricted row drawn the same way and, on CPUs with AMX, a quantized bf16 "
        "model's linears of few rows on the tiles rather than in exact integer products; costs up to ~10%% on long "
        "bf16 prefills (4k tokens) and, on AMX CPUs, 40-50%% of a quantized model's one-stream decode rate",
        scope=(WORKER,))
    quantization: str = _setting(
        "none", "int8: keep the linears and the output head of a safetensors checkpoint as int8 blocks on CPU (one "
        "rank), 32 weights and one fp16 scale each, dequantized to fp32 in registers; a quarter of fp32's bytes "
        "to read per token (default: %(default)s)", scope=(WORKER,), check=_one_of(QUANTIZATIONS),
        choices=QUANTIZATIONS)
    int8_activations: bool = _setting(
        False, "multiply quantized weights (a GGUF's Q4_0, Q4_1 and Q8_0 blocks, --quantization int8) by activations "
        "rounded to int8 per block of 32 values, as llama.cpp does, in integer arithmetic on CPU: about twice the "
        "throughput of the fp32 multiply-adds on AVX2 CPUs at many rows, but the outputs are no longer the "
        "dequantized model's (on AVX-512 BF16 CPUs the default bf16 arithmetic is faster)", scope=(WORKER,))
    gguf_weights: str = _setting(
        "auto", "how a .gguf model's weights are served on CPU with one rank: quantized: from the file's Q4_0, "
        "Q4_1 and Q8_0 blocks as they are (memory about the file's size), an error for other block types; "
        "dequantize: the fp32 copy converted once (as on CUDA); auto: quantized where every tensor's type is "
        "served so, else dequantized (default: %(default)s)", scope=(WORKER,), check=_one_of(GGUF_WEIGHTS),
        choices=GGUF_WEIGHTS)
    worker: str = _setting(
        "model", "model: run the model (default); null: no model math, return fixed ordinary tokens (logprob 0, "
        "and -10000 for the others of a top list) using --model's config and tokenizer only, to measure the "
        "control plane (scheduler, gRPC, streaming)",
        scope=(WORKER,), check=_one_of(WORKER_KINDS), choices=WORKER_KINDS)

    # ---- scheduler core: batching and admission ---------------------------------------------
    max_num_batched_tokens: int = _setting(
        512, "token budget of one step: prefill chunks + decodes (default: %(default)s)", scope=(CORE,),
        check=_at_least(1), type=int)
    max_num_seqs: int = _setting(
        256, "most sequences running at once (default: %(default)s)", scope=(CORE,), check=_at_least(1), type=int)
    enable_prefix_caching: bool = _setting(
        True, "turn the prefix cache off", scope=(CORE,), negate="--no-prefix-cache")
    max_queued_requests: int = _setting(
        1024, "requests waiting for room in the batch (beyond those that start at the next step) past this many "
        "get RESOURCE_EXHAUSTED; 0: no queue, a request is taken only when it "
        "can start at once (its samples fit under --max-num-seqs beside those running and about to start) "
        "(default: %(default)s)", scope=(CORE,),
        check=_at_least(0), type=int)
    overlap: bool = _setting(
        True, "wait for each step's result before sending the next plan (default: overlap on, with --plans-in-flight "
        "plans sent ahead of their results)",
        scope=(CORE,), negate="--no-overlap")
    plans_in_flight: int | None = _setting(
        None, "with overlap, the step plans the core keeps sent ahead of their results: 2 (plan N+1 is built while "
        "the worker runs step N) or 3 (plan N+2 as well, so the core's work on result N and the worker's launch of "
        "step N+2 both overlap the device's step N+1: it pays with a worker that launches its steps ahead); a "
        "sequence that stops computes up to N-1 tokens that are dropped (default: 3 with a CUDA worker, else 2)",
        scope=(CORE,), check=_between(2, 3), type=int, metavar="N")
    admission_turns: int = _setting(
        32, "with overlap, after each step let the core's event loop turn up to this many times while new "
        "requests keep arriving, so that a busy engine fills its batches instead of stepping once per arrival; 0: "
        "step at once (default: %(default)s)", scope=(CORE,), check=_at_least(0), type=int)
    prefill_pacing_steps: int = _setting(
        0, "while sequences are decoding, let a step carry only 1/N of the prompt tokens waiting to be "
        "computed (at least 16), so that prompts arriving in bursts are spread over the next steps and streams "
        "see an even inter-token latency, at the cost of a longer time to first token; a growing backlog raises "
        "the share, and with nothing decoding prompts get the whole budget. Try 32-64 for interactive streaming "
        "with long prompts; 0: off, prompts take what the budget leaves (default: %(default)s)",
        scope=(CORE,), check=_at_least(0), type=int, metavar="N")

    # ---- API servers: how each serves its clients ---------------------------------------------
    stream_interval: int = _setting(
        1, "after a request's first token, send a response once this many tokens are ready (fewer, larger "
        "messages under heavy load; default: %(default)s, every token)", scope=(API,), check=_at_least(1), type=int)
    chat_template: str | None = _setting(
        None, "a Jinja chat template for chat requests (gRPC Chat, /v1/chat/completions) in place of the model's "
        "own: a file's path, or the template itself (text with a { or a line break); it renders `messages` and "
        "`add_generation_prompt`, with `bos_token`, `eos_token` and `raise_exception` at hand, and is checked at "
        "start (default: the model's, from tokenizer_config.json or chat_template.jinja)", scope=(API,),
        check=_chat_template, type=str, metavar="PATH|TEMPLATE")
    grpc_listeners: int = _setting(
        8, "gRPC servers each API server runs on the public address (SO_REUSEPORT: the kernel spreads "
        "connections over them). grpc.aio takes in one new call at a time per server, several turns of a "
        "busy event loop apart, so under heavy streaming one server admits about one call per engine step "
        "and new calls queue; with more, calls on different connections are taken in side by side. A unix "
        "socket address gets one (default: %(default)s)", scope=(API,), check=_at_least(1), type=int, metavar="N")

    data_parallel_routing: str = _setting(
        "cache-aware", "how each API server picks the engine core of a request when there are several "
        "(--data-parallel-size, --data-parallel-cores): cache-aware: the core holding the longest cached prefix "
        "of the prompt's full blocks (from the cores' KV events), unless its running + waiting requests exceed the "
        "least loaded core's by more than --data-parallel-balance-threshold, then the least loaded; round-robin: "
        "in turn; least-loaded: the fewest running + waiting requests (default: %(default)s)", scope=(API,),
        check=_one_of(ROUTINGS), choices=ROUTINGS)
    data_parallel_balance_threshold: int = _setting(
        16, "cache-aware routing sends a request to the core with its longest cached prefix only while that core's "
        "running + waiting requests exceed the least loaded core's by at most this many (default: %(default)s)",
        scope=(API,), check=_at_least(0), type=int, metavar="N")

    # ---- observability: every process that runs steps ----------------------------------------
    profile_steps: int = _setting(
        0, "time the phases of each step in every process (worker: wait for plan, plan decode, apply plan, "
        "prepare inputs, forward, prompt logprobs, sample, result send, and with launch-ahead wait for plan or "
        "tokens, wait for tokens; core: wait for API servers, schedule, plan send, wait for "
        "result, result decode, apply result, deliver, admission turns; API server: outputs decode, dispatch, "
        "hand on, handlers) and log one line 'step profile {json}' every N steps per process: its role, steps, "
        "tokens, wall and CPU time, and per phase the total µs, µs per step and µs per token. Host wall time: on "
        "CUDA the worker's phases measure kernel launches, and sample waits for the GPU. pagewire.LLM takes it too "
        "(its phases in one process; LLM.profile() returns the figures); 0: off, at no cost (default: %(default)s)",
        scope=(WORKER, CORE, API), check=_at_least(0), type=int, metavar="N")

    # ---- processes ----------------------------------------------------------------------------
    api_servers: int = _setting(
        1, "API-server processes sharing the public address (SO_REUSEPORT: the kernel spreads connections); "
        "each tokenizes, detokenizes and streams its own clients (default: %(default)s)", scope=(PROCESS,),
        check=_at_least(1), type=int, metavar="N")
    data_parallel_size: int = _setting(
        1, "engine cores on this machine, each with its own worker (on CUDA worker i takes cuda:i, or GPUs "
        "i*T..i*T+T-1 with --tensor-parallel-size T), behind the same API servers, which route each request to "
        "one of them (--data-parallel-routing) (default: %(default)s)", scope=(PROCESS,), check=_at_least(1),
        type=int, metavar="N")
    data_parallel_cores: str | None = _setting(
        None, "engine cores on other machines (each `pagewire core --listen HOST:PORT`) that the API servers "
        "take requests to besides the local ones; a core that is down is left out of the routing until it is "
        "back (default: none)", scope=(PROCESS,), check=_core_addresses, type=str, metavar="HOST:PORT[,...]")
    http_listen: str = _setting(
        "127.0.0.1:8000", "address of the OpenAI-compatible HTTP API and /metrics on every API server, host:port, "
        "or off (default: %(default)s)", scope=(PROCESS,), check=_http_address, type=str, metavar="ADDR")
    shutdown_timeout: float = _setting(
        30.0, "seconds to let running requests finish on SIGTERM (default: %(default)s)", scope=(PROCESS,),
        check=_at_least(0), type=float)

    # ---- the public address: who may call, and over what --------------------------------------
    api_key: str | None = _setting(
        None, "require every call to carry the metadata 'authorization: Bearer KEY' (gRPC health and reflection "
        "stay open); calls without it get UNAUTHENTICATED. Prefer the environment variable PAGEWIRE_API_KEY: "
        "a flag shows in the process list (default: $PAGEWIRE_API_KEY, else no key)", scope=(PUBLIC,),
        check=_non_empty, metavar="KEY", env=envs.API_KEY_ENV, secret=True)
    tls_cert_file: str | None = _setting(
        None, "serve the public address over TLS with this PEM certificate (chain), with --tls-key-file "
        "(default: plaintext; the links between pagewire's own processes never use TLS: keep those on unix sockets, "
        "loopback or a private network)",
        scope=(PUBLIC,), check=_non_empty, metavar="PATH")
    tls_key_file: str | None = _setting(
        None, "the PEM private key of --tls-cert-file", scope=(PUBLIC,), check=_non_empty, metavar="PATH")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = check(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(problem)
        _check_ranks(self)
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("--tls-cert-file and --tls-key-file go together: give both or neither")

    @property
    def num_ranks(self) -> int:
        """The worker's tensor-parallel ranks (``--world-size`` when given, else ``--tensor-parallel-size``)."""
        return self.world_size or self.tensor_parallel_size

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)

    def to_argv(self, scopes: tuple[str, ...]) -> list[str]:
        """The flags that reproduce the non-default settings of ``scopes`` (for a child process)."""
        argv: list[str] = []
        for f in _fields(scopes):
            value = getattr(self, f.name)
            if value == f.default or f.metadata["secret"]:
                continue
            meta = f.metadata
            if meta["negate"]:
                argv.append(meta["negate"])  # only a default-True bool can differ: it is off
            elif f.default is False:
                argv.append(flag_of(f))  # a default-False bool (--deterministic): it is on
            else:
                argv += [flag_of(f), str(value)]
        return argv

    def to_env(self, scopes: tuple[str, ...]) -> dict[str, str]:
        """The environment variables that hand a child the secret settings of ``scopes``."""
        return {f.metadata["env"]: getattr(self, f.name) for f in _fields(scopes)
                if f.metadata["secret"] and getattr(self, f.name) is not None}

    @classmethod
    def from_kwargs(cls, **given) -> "Settings":
        """Settings from Python keyword arguments (``pagewire.LLM``): a setting not given takes its
        default from its environment variable where it has one, as its flag does."""
        for f in dataclasses.fields(cls):
            env = f.metadata.get("env")
            if env and f.name not in given and not f.metadata["secret"] and envs.read(env):
                given[f.name] = envs.read(env)
        return cls(**given)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "Settings":
        """Settings from a parsed namespace: the fields it has, defaults for the rest."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        given.update(overrides)
        return cls(**given)


def _check_ranks(settings: "Settings") -> None:
    """The ranks' settings agree: --rank needs --world-size and --distributed-init, and the world
    is the tensor-parallel group (every rank holds one shard)."""
    tp, world, rank = settings.tensor_parallel_size, settings.world_size, settings.rank
    if world is not None and tp not in (1, world):
        raise ValueError(f"--world-size ({world}) must equal --tensor-parallel-size ({tp}): every rank is a "
                         "tensor-parallel rank")
    if rank is not None:
        if world is None or settings.distributed_init is None:
            raise ValueError("--rank needs --world-size and --distributed-init (the address rank 0 listens on)")
        if rank >= world:
            raise ValueError(f"--rank ({rank}) must be below --world-size ({world})")


SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(Settings))
# what the offline engine (``pagewire.LLM``: the worker and the engine core in one process, no
# event loop) takes: the worker's and the core's settings, less the core service's admission turns
# and pipeline depth (offline, ``overlap`` keeps one plan ahead of the step that runs)
OFFLINE_SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(Settings)
                                  if {WORKER, CORE} & set(f.metadata["scope"])) - {"admission_turns", "plans_in_flight"}
_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _fields(scopes: tuple[str, ...]):
    return [f for f in dataclasses.fields(Settings) if set(f.metadata["scope"]) & set(scopes)]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["negate"] or f.metadata["flag"] or "--" + f.name.replace("_", "-")


def default_of(name: str):
    """The declared default of a setting (for the per-process config types)."""
    return _FIELDS[name].default


def check(name: str, value) -> str | None:
    """What is wrong with ``value`` for setting ``name`` (None when it is fine), naming the flag."""
    f = _FIELDS[name]
    checker = f.metadata["check"]
    problem = checker(value) if checker else None
    return f"{flag_of(f)} ({name}) {problem}" if problem else None


def check_all(obj, names) -> None:
    """Run the declared checks of ``names`` on ``obj``'s attributes (``ValueError``)."""
    for name in names:
        problem = check(name, getattr(obj, name))
        if problem:
            raise ValueError(problem)


def add_arguments(parser: argparse.ArgumentParser, scopes: tuple[str, ...], *, title: str | None = None,
                  unset_defaults: bool = False, skip: tuple[str, ...] = ()) -> None:
    """Add the flags of the settings in ``scopes`` to ``parser``. With ``unset_defaults`` every
    flag defaults to None (a caller that passes on only what was given, like the bench). A setting
    of several scopes gets one flag per parser, from the first call that covers it."""
    group = parser.add_argument_group(title) if title else parser
    added = parser.__dict__.setdefault("pagewire_settings", set())  # the settings this parser has flags for
    for f in _fields(scopes):
        if f.name in skip or f.name in added:
            continue
        added.add(f.name)
        meta = f.metadata
        if meta["negate"]:
            group.add_argument(meta["negate"], dest=f.name, action="store_const", const=False,
                               default=None if unset_defaults else f.default, help=meta["help"])
            continue
        if f.default is False:  # a default-False bool: the bare flag turns it on
            group.add_argument(flag_of(f), dest=f.name, action="store_const", const=True,
                               default=None if unset_defaults else False, help=meta["help"])
            continue
        default = f.default
        if meta["env"] and not unset_defaults:
            default = envs.read(meta["env"]) or default
        kwargs: dict[str, Any] = dict(dest=f.name, default=None if unset_defaults else default, help=meta["help"])
        if meta["type"] is not None:
            kwargs["type"] = _argparse_type(f.name, meta["type"])
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        if meta["metavar"]:
            kwargs["metavar"] = meta["metavar"]
        if unset_defaults:
            kwargs["help"] = kwargs["help"].replace("%(default)s", str(f.default))
        group.add_argument(flag_of(f), **kwargs)


def _argparse_type(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """The flag's parser, with the declared check applied, so a bad value is a usage error."""

    def convert(text: str):
        try:
            value = parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e) if "not a size" in str(e) else f"not a number: {text!r}") from None
        problem = _FIELDS[name].metadata["check"](value) if _FIELDS[name].metadata["check"] else None
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return value

    convert.__name__ = parse.__name__
    return convert
