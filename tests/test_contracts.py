"""Contracts that must not drift: generated stubs, the proto surface, the import graph."""

from __future__ import annotations

import filecmp
import subprocess
import sys

from pagewire_common import protogen
from tests.service_utils import REPO


def test_stubs_are_current(tmp_path):
    """The stubs in pagewire_common/v1 are exactly what protoc generates from protos/ now."""
    generated = protogen.generate(tmp_path)
    for fresh in generated:
        in_tree = REPO / "pagewire_common" / "v1" / fresh.name
        assert in_tree.exists(), f"{in_tree} missing: run make protos"
        assert filecmp.cmp(fresh, in_tree, shallow=False), f"{in_tree} is stale: run make protos"


def test_stale_stubs_are_regenerated_on_import(tmp_path):
    """A .proto newer than its stubs makes `import pagewire_common.v1` regenerate them."""
    import os

    stub = REPO / "pagewire_common/v1/generation_pb2.py"
    old = (REPO / "protos/pagewire/v1/generation.proto").stat().st_mtime - 3600
    os.utime(stub, (old, old))
    assert protogen.is_stale()
    out = subprocess.run([sys.executable, "-c", "import pagewire_common.v1"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert not protogen.is_stale()
    assert stub.stat().st_mtime > old + 60


def test_public_contract_names():
    from pagewire_common.v1 import generation_pb2 as pb
    from pagewire_common.v1 import worker_pb2 as wpb

    gen = pb.DESCRIPTOR.services_by_name["Generation"]
    assert {m.name for m in gen.methods} >= {"Generate", "Chat", "GetModelInfo", "GetStats"}
    assert gen.methods_by_name["Generate"].server_streaming
    assert pb.DESCRIPTOR.package == "pagewire.v1"
    fields = lambda msg: set(msg.DESCRIPTOR.fields_by_name)  # noqa: E731
    assert fields(pb.GenerateRequest) >= {"request_id", "prompt", "prompt_token_ids", "sampling"}
    assert fields(pb.SamplingParams) >= {
        "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs",
    }
    assert fields(pb.GenerateResponse) >= {"token_ids", "text", "finish_reason", "usage", "logprobs"}
    assert fields(pb.Usage) == {"prompt_tokens", "completion_tokens", "cached_prompt_tokens"}
    assert fields(pb.Stats) >= {
        "num_total_blocks", "num_free_blocks", "num_running", "num_waiting",
        "num_requests_finished", "num_requests_aborted", "num_requests_rejected",
    }
    assert [v.name for v in pb.FinishReason.DESCRIPTOR.values] == ["UNSPECIFIED", "STOP", "LENGTH"]
    worker = wpb.DESCRIPTOR.services_by_name["Worker"]
    execute = worker.methods_by_name["Execute"]  # a session: plans and results go on its frame link
    assert execute.server_streaming and execute.input_type.name == "LinkOpen"
    assert "Info" in worker.methods_by_name


def test_scheduler_never_imports_torch():
    code = (
        "import sys\n"
        "import scheduler_svc.api.server, scheduler_svc.api.main, scheduler_svc.core.main, scheduler_svc.core.service, scheduler_svc.core.engine\n"
        "import scheduler_svc.api.text_stream, pagewire.serve, pagewire_common.settings, pagewire_common.supervisor\n"
        "import pagewire, pagewire.cli, pagewire.client, pagewire_common.wire\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
        "assert not any(m.startswith('worker_svc') for m in sys.modules), 'worker_svc was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_services_do_not_import_each_other():
    for package, other in (("scheduler_svc", "worker_svc"), ("worker_svc", "scheduler_svc")):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            assert f"from {other}" not in text and f"import {other}" not in text, f"{path} imports {other}"


def test_cli_help_lists_commands():
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("serve", "worker", "scheduler", "generate"):
        assert command in out.stdout
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "serve", "--help"], cwd=REPO, capture_output=True, text=True)
    for flag in ("--model", "--listen", "--block-size", "--max-num-batched-tokens", "--no-prefix-cache", "--no-overlap"):
        assert flag in out.stdout


def test_layers_import_only_downwards():
    """pagewire_common (the floor) imports no other layer; kvcache and the services never import
    the face (pagewire/), which nothing below imports."""
    import re

    rules = {
        "pagewire_common": ("pagewire", "kvcache", "scheduler_svc", "worker_svc"),
        "kvcache": ("pagewire", "scheduler_svc", "worker_svc"),
        "scheduler_svc": ("pagewire", "worker_svc"),
        "worker_svc": ("pagewire", "scheduler_svc"),
    }
    for package, forbidden in rules.items():
        for path in (REPO / package).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for line in path.read_text().splitlines():
                m = re.match(r"\s*(?:from|import)\s+([\w.]+)", line)
                if m:
                    top = m.group(1).split(".")[0]
                    assert top not in forbidden, f"{path.relative_to(REPO)} imports {m.group(1)}"


def test_benchmarks_feed_a_section_and_use_public_names():
    """Every script in benchmarks/ names the section of docs/benchmarks.md it feeds (a heading that
    exists), and imports nothing from tests/ and no other module's private (_name) names."""
    import ast
    import re

    headings = [line.lstrip("#").strip() for line in (REPO / "docs/benchmarks.md").read_text().splitlines()
                if line.startswith("#")]
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    assert scripts
    for path in scripts:
        tree = ast.parse(path.read_text())
        doc = " ".join((ast.get_docstring(tree) or "").split())
        m = re.search(r'docs/benchmarks\.md, section "([^"]+)"', doc)
        assert m, f"{path.name}: the docstring names no section of docs/benchmarks.md"
        assert any(h.startswith(m.group(1)) for h in headings), f"{path.name}: no heading {m.group(1)!r}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules, names = [a.name for a in node.names], []
            elif isinstance(node, ast.ImportFrom):
                modules, names = [node.module or ""], [a.name for a in node.names]
            else:
                continue
            for module in modules:
                assert module.split(".")[0] not in ("tests", "benchmarks"), f"{path.name} imports {module}"
                assert not any(part.startswith("_") for part in module.split(".") if part != "__future__"), \
                    f"{path.name} imports the private module {module}"
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{path.name} imports private names {private} from {modules[0]}"


def test_readme_shows_only_flags_that_exist():
    """Every flag README.md shows is an option of some pagewire command, and a command line it shows
    (`pagewire CMD ...`, in a code block or in backticks) uses only that command's options."""
    import re

    from pagewire.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    options = {name: set(p._option_string_actions) for name, p in commands.items()}
    everywhere = set(parser._option_string_actions).union(*options.values())
    text = (REPO / "README.md").read_text()
    # docker compose's own flags (--build) are not ours
    ours = "\n".join(line for line in text.splitlines() if "docker" not in line)
    unknown = sorted(set(re.findall(r"--[a-z][a-z0-9-]*", ours)) - everywhere)
    assert not unknown, f"README.md shows flags no command has: {unknown}"

    fence = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
    blocks = [body for lang, body in fence.findall(text) if lang in ("bash", "sh", "")]
    lines = [line.split(" #")[0] for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    lines += re.findall(r"`([^`\n]+)`", fence.sub("", text))
    checked = 0
    for line in lines:
        for m in re.finditer(r"\bpagewire ([a-z-]+)((?: [^ ]+)*)", line):
            command, rest = m.group(1), m.group(2)
            if command not in options:
                continue
            checked += 1
            wrong = sorted(set(re.findall(r"--[a-z][a-z0-9-]*", rest)) - options[command])
            assert not wrong, f"README.md: `pagewire {command}` has no {wrong} (in {line.strip()!r})"
    assert checked >= 8


def _project_imports() -> dict[str, set[str]]:
    """Each project module (dotted name) and the project modules it imports anywhere in its file
    (top level, functions, TYPE_CHECKING blocks): ``from a.b import c`` counts as ``a.b.c`` when
    that is a module, else ``a.b``."""
    import ast

    roots = ("pagewire", "pagewire_common", "kvcache", "scheduler_svc", "worker_svc")
    modules: dict[str, object] = {}
    for root in roots:
        for path in (REPO / root).rglob("*.py"):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if is_package else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join(package + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    deps.add(target)
        graph[name] = deps
    return graph


def test_api_servers_and_core_are_apart():
    """The API servers' package and the core's share only the floor: neither imports the other,
    and the core (the tokenizer included) never sees text."""
    graph = _project_imports()
    for module, deps in graph.items():
        if module.startswith("scheduler_svc.api"):
            assert not [d for d in deps if d.startswith("scheduler_svc.core")], f"{module} imports the core: {deps}"
        if module.startswith("scheduler_svc.core"):
            assert not [d for d in deps if d.startswith("scheduler_svc.api")], f"{module} imports the API side: {deps}"


def test_no_import_cycles():
    """No two project modules import each other, directly or around a loop (lazy and
    TYPE_CHECKING imports count: a cycle there is still two modules that know each other). A
    package's ``__init__`` importing its own modules is not a cycle."""
    graph = _project_imports()
    for module, deps in graph.items():
        graph[module] = {d for d in deps if not module.startswith(d + ".")}  # a module's own package
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_cpu_kernels_live_in_one_package():
    """The worker's CPU kernels are one package, worker_svc/cpu: every C source of the project lies
    in its csrc/ (which pyproject ships), no module outside it imports its build or reads
    /proc/cpuinfo itself (they go through it: worker_svc.cpu.features, .prepare, ...), and kvcache
    gets the CPU attention kernel by registration, never by import. Tests are left out: they test
    the build itself."""
    import ast
    import tomllib

    package = REPO / "worker_svc" / "cpu"
    roots = ("pagewire", "pagewire_common", "kvcache", "scheduler_svc", "worker_svc")
    sources = sorted(p.relative_to(REPO).as_posix() for root in roots for p in (REPO / root).rglob("*.c"))
    assert sources and all(s.startswith("worker_svc/cpu/csrc/") for s in sources), sources
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert package_data.get("worker_svc") == ["cpu/csrc/*.c"], package_data

    for module, deps in _project_imports().items():
        if module == "worker_svc.cpu" or module.startswith("worker_svc.cpu."):
            continue
        assert "worker_svc.cpu.build" not in deps, f"{module} imports the C build; go through worker_svc.cpu"
        if module.startswith("kvcache"):
            assert not [d for d in deps if d.startswith("worker_svc")], f"{module} imports the worker: {deps}"
    # llama.cpp's build key reads the CPU's flags itself (pagewire.bench.llamacpp.cpu_flags): the one
    # reader left to move onto worker_svc.cpu.features; no new one.
    own_readers = {REPO / "pagewire/bench/llamacpp.py"}
    paths = [p for root in roots for p in (REPO / root).rglob("*.py") if not p.is_relative_to(package)]
    for path in paths + sorted((REPO / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "worker_svc.cpu":
                assert "build" not in [a.name for a in node.names], f"{path.relative_to(REPO)} imports the C build"
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert "worker_svc.cpu.build" not in names, f"{path.relative_to(REPO)} imports the C build"
            elif isinstance(node, ast.Constant) and node.value == "/proc/cpuinfo" and path not in own_readers:
                raise AssertionError(f"{path.relative_to(REPO)} reads /proc/cpuinfo: use worker_svc.cpu.features")


def test_cpu_features_import_without_torch():
    """The bench records the host's ISA from worker_svc.cpu.features in a process without torch."""
    code = (
        "import sys\n"
        "import worker_svc.cpu.features, pagewire.bench.report\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
