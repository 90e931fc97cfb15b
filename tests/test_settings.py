"""One declaration of every setting (pagewire_common.settings): flags, LLM keywords, child-process
flags, configs and the bench's pass-through all derive from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagewire.cli import build_parser
from pagewire_common.settings import ALL_SCOPES, API, CORE, PROCESS, PUBLIC, WORKER, Settings, add_arguments, flag_of
from scheduler_svc.core.config import SchedulerConfig

FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
# the settings of each command's process(es)
COMMANDS = {
    "serve": (WORKER, CORE, API, PROCESS, PUBLIC),
    "worker": (WORKER,),
    "scheduler": (CORE, API, PROCESS, PUBLIC),
    "api-server": (API, PUBLIC),
}
REQUIRED = {"worker": ["--listen", "x"], "scheduler": ["--worker", "x"], "api-server": ["--scheduler", "x"]}
# a non-default value for each setting, to see it travel
SAMPLE = dict(model="/m", served_model_name="m", dtype="bfloat16", device="cpu", block_size=8, num_kv_blocks=77,
              kv_cache_bytes=1 << 20, max_model_len=99, num_threads=3, cuda_graphs=False, cuda_graph_max_batch=12,
              deterministic=True, worker="null", max_num_batched_tokens=48, max_num_seqs=5, enable_prefix_caching=False,
              max_queued_requests=7, overlap=False, admission_turns=4, prefill_pacing_steps=9, profile_steps=6,
              stream_interval=3, chat_template="{{ messages[0].content }}", quantization="int8", gguf_weights="dequantize", int8_activations=True,
              launch_ahead="on", plans_in_flight=3,
              grpc_listeners=2, api_servers=2, http_listen="127.0.0.1:9", shutdown_timeout=4.5, tensor_parallel_size=2,
              distributed_init="10.0.0.1:29500", rank=1, world_size=2, api_key="k3y", tls_cert_file="/c.pem",
              tls_key_file="/k.pem", data_parallel_size=3, data_parallel_cores="10.0.0.2:7000,10.0.0.3:7000",
              data_parallel_routing="round-robin", data_parallel_balance_threshold=5)
# serve's own: the processes it starts are given addresses instead
DATA_PARALLEL_LAYOUT = ("data_parallel_size", "data_parallel_cores")


def test_every_setting_has_help_a_scope_and_a_sample():
    assert set(SAMPLE) == set(FIELDS)
    for f in FIELDS.values():
        assert f.metadata["help"] and set(f.metadata["scope"]) <= set(ALL_SCOPES), f.name


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_has_the_flags_of_its_scopes_with_the_declared_defaults(command, monkeypatch):
    monkeypatch.delenv("PAGEWIRE_DTYPE", raising=False)  # conftest pins float32 for the other tests
    parser = build_parser()
    args = parser.parse_args([command, *REQUIRED.get(command, [])])
    scopes = COMMANDS[command]
    for name, f in FIELDS.items():
        wanted = bool(set(f.metadata["scope"]) & set(scopes)) and not (command == "api-server" and name == "api_servers")
        if command in ("scheduler", "api-server") and name in DATA_PARALLEL_LAYOUT:
            wanted = False
        if command == "api-server" and name in ("shutdown_timeout", "http_listen"):
            wanted = True
        assert hasattr(args, name) == wanted, (command, name)
        if wanted:
            assert getattr(args, name) == f.default, (command, name)
    assert Settings.from_args(args) == Settings()


def test_child_flags_round_trip_through_the_commands_that_run_them(monkeypatch):
    for command, scopes in COMMANDS.items():
        settings = Settings(**SAMPLE)
        if command != "serve":
            settings = settings.replace(data_parallel_size=1, data_parallel_cores=None)
        argv = settings.to_argv(scopes)
        assert "k3y" not in argv  # a secret travels in the environment, never on a command line
        monkeypatch.delenv("PAGEWIRE_API_KEY", raising=False)
        for name, value in settings.to_env(scopes).items():
            monkeypatch.setenv(name, value)
        parser = build_parser()  # flag defaults are read from the environment when it is built
        parsed = Settings.from_args(parser.parse_args([command, *REQUIRED.get(command, []), *argv]))
        for name, f in FIELDS.items():
            if set(f.metadata["scope"]) & set(scopes) and hasattr(parser.parse_args([command, *REQUIRED.get(command, [])]), name):
                assert getattr(parsed, name) == getattr(settings, name), (command, name)
    assert Settings().to_argv(ALL_SCOPES) == [] and Settings().to_env(ALL_SCOPES) == {}  # defaults are not repeated
    assert "k3y" not in repr(settings)


def test_the_api_key_defaults_to_its_environment_variable_and_tls_files_go_in_pairs(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("PAGEWIRE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None
    with pytest.raises(ValueError, match="--api-key"):
        Settings(api_key="")
    with pytest.raises(ValueError, match="--tls-cert-file and --tls-key-file go together"):
        Settings(tls_cert_file="/c.pem")


@pytest.mark.parametrize("name, bad", [("max_num_seqs", 0), ("block_size", 12), ("dtype", "int4"),
                                       ("admission_turns", -1), ("api_servers", 0), ("max_model_len", 1),
                                       ("worker", "gpu"), ("shutdown_timeout", -1.0),
                                       ("shutdown_timeout", float("nan")), ("device", "gpu")])
def test_bad_values_are_refused_by_the_flag_and_by_the_object(name, bad, capsys):
    with pytest.raises(ValueError, match=flag_of(FIELDS[name])):
        Settings(**{name: bad})
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", flag_of(FIELDS[name]), str(bad)])
    assert flag_of(FIELDS[name]) in capsys.readouterr().err


def test_rank_settings_must_agree():
    assert Settings(tensor_parallel_size=4).num_ranks == 4
    assert Settings(world_size=4, rank=0, distributed_init="h:1").num_ranks == 4  # --world-size alone sets it
    with pytest.raises(ValueError, match="--world-size .* must equal --tensor-parallel-size"):
        Settings(tensor_parallel_size=2, world_size=4)
    with pytest.raises(ValueError, match="--rank needs --world-size and --distributed-init"):
        Settings(rank=1, world_size=2)
    with pytest.raises(ValueError, match="--rank .* must be below --world-size"):
        Settings(rank=2, world_size=2, distributed_init="h:1")
    with pytest.raises(ValueError, match="--distributed-init"):
        Settings(distributed_init="no-port")
    with pytest.raises(ValueError, match="--tensor-parallel-size"):
        Settings(tensor_parallel_size=0)


def test_component_configs_take_their_defaults_and_checks_from_the_settings():
    from worker_svc.runner import RunnerConfig

    config = SchedulerConfig(max_model_len=64)
    for name in ("max_num_batched_tokens", "max_num_seqs", "enable_prefix_caching", "max_queued_requests",
                 "prefill_pacing_steps"):
        assert getattr(config, name) == FIELDS[name].default
    runner = RunnerConfig()
    for name in ("block_size", "num_kv_blocks", "kv_cache_bytes", "dtype", "device", "max_model_len", "cuda_graphs",
                 "cuda_graph_max_batch", "deterministic"):
        assert getattr(runner, name) == FIELDS[name].default
    with pytest.raises(ValueError, match="--max-num-seqs"):
        SchedulerConfig(max_model_len=64, max_num_seqs=0)
    with pytest.raises(ValueError, match="--block-size"):
        RunnerConfig(block_size=3)
    s = Settings(**SAMPLE)
    assert SchedulerConfig.from_settings(s, 1000).max_model_len == 99  # capped by --max-model-len
    assert SchedulerConfig.from_settings(s, 50).max_model_len == 50  # and by the worker's
    assert RunnerConfig.from_settings(s).num_kv_blocks == 77


# repeated defaults in files whose owners have not derived them yet: (path, name)
def test_no_default_is_repeated_as_a_literal():
    """A keyword argument or config field named like a setting or a SamplingParams field takes its
    default from the declaration (``default_of``, ``DEFAULT_SAMPLING``), not from a copy of the
    literal, which would drift. A literal that differs is a choice of its own (a client that is
    greedy unless told), and an empty or zero one means "none" (no stop strings): neither is flagged."""
    import ast

    from pagewire_common.sampling import SamplingParams
    from tests.service_utils import REPO

    declared: dict[str, list] = {}
    for f in (*dataclasses.fields(Settings), *dataclasses.fields(SamplingParams)):
        if f.default is not dataclasses.MISSING and f.default is not None:
            declared.setdefault(f.name, []).append(f.default)
    declarations = {"pagewire_common/settings.py", "pagewire_common/sampling.py"}
    repeated = set()
    for root in ("pagewire", "pagewire_common", "kvcache", "scheduler_svc", "worker_svc"):
        for path in (REPO / root).rglob("*.py"):
            where = path.relative_to(REPO).as_posix()
            if where in declarations or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    params = a.posonlyargs + a.args
                    pairs = list(zip(params[len(params) - len(a.defaults):], a.defaults))
                    pairs += [(arg, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None]
                    named = [(arg.arg, d) for arg, d in pairs]
                elif isinstance(node, ast.ClassDef):
                    named = [(n.target.id, n.value) for n in node.body
                             if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None]
                else:
                    continue
                for name, value in named:
                    if name not in declared:
                        continue
                    try:
                        literal = ast.literal_eval(value)
                    except ValueError:
                        continue  # not a literal: derived, or computed
                    if literal and any(type(literal) is type(d) and literal == d for d in declared[name]):
                        repeated.add((where, name))
    assert not repeated, sorted(repeated)


def test_llm_takes_the_settings_as_keywords(tiny_model_dir):
    from pagewire import LLM

    with pytest.raises(TypeError, match="unknown settings"):
        LLM(tiny_model_dir("llama-gqa"), max_num_seq=4)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        LLM(tiny_model_dir("llama-gqa"), max_num_seqs=0)
    llm = LLM(tiny_model_dir("llama-gqa"), block_size=4, num_kv_blocks=50)
    assert llm.engine.config.max_num_seqs == FIELDS["max_num_seqs"].default
    assert llm.engine.allocator.num_blocks == 50 and llm.runner.block_size == 4


def test_the_bench_passes_every_engine_setting_through():
    from pagewire.bench.server import passthrough_flags, serve_argv

    parser = build_parser()
    passed = {name for _flag, name in passthrough_flags()}
    # the bench's client sends no key and speaks plaintext: the public address's settings stay out
    assert passed == set(FIELDS) - {"served_model_name", "shutdown_timeout", "api_key", "tls_cert_file", "tls_key_file"}
    argv = ["bench", "--serve"]
    for flag, name in passthrough_flags():
        if FIELDS[name].metadata["negate"] or FIELDS[name].default is False:
            argv.append(flag)  # a bool's bare flag: --no-prefix-cache, --deterministic
        else:
            argv += [flag, str(SAMPLE[name])]
    cmd = serve_argv(parser.parse_args(argv), "127.0.0.1:1")
    served = Settings.from_args(parser.parse_args(cmd[cmd.index("--log-level"):]))
    for name in passed:
        assert getattr(served, name) == SAMPLE[name], name


def test_pagewire_dtype_sets_the_default_dtype_of_every_command_and_of_llm(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_DTYPE", "bfloat16")
    parser = argparse.ArgumentParser()
    add_arguments(parser, (WORKER,))
    assert parser.parse_args([]).dtype == "bfloat16"
    assert parser.parse_args(["--dtype", "float32"]).dtype == "float32"  # a flag wins
    assert Settings.from_kwargs().dtype == "bfloat16"
    assert Settings.from_kwargs(dtype="float32").dtype == "float32"  # an argument wins
    assert Settings().dtype == "auto"  # the declared default itself is unchanged
    monkeypatch.setenv("PAGEWIRE_DTYPE", "int4")
    with pytest.raises(ValueError, match="dtype"):
        Settings.from_kwargs()


def test_the_offline_llm_refuses_settings_of_the_served_path():
    """LLM takes the worker's and the core's settings; one that only the served processes read
    (an API-server flag, the core service's admission turns and pipeline depth) is a TypeError,
    not ignored."""
    from pagewire import LLM
    from pagewire_common.settings import OFFLINE_SETTING_NAMES

    for name, value in (("admission_turns", 4), ("plans_in_flight", 3), ("api_servers", 2), ("stream_interval", 8),
                        ("chat_template", "{{ messages }}")):
        assert name not in OFFLINE_SETTING_NAMES
        with pytest.raises(TypeError, match=name):
            LLM(**{name: value})
    assert {"overlap", "max_num_seqs", "block_size", "dtype"} <= OFFLINE_SETTING_NAMES
