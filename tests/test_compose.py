"""docker-compose.yml stays valid and its commands run as plain processes (no Docker engine
here), so the file cannot drift from the code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import REPO, Proc, free_port, sampling, stub

COMPOSE = REPO / "docker-compose.yml"
COMPOSE_GPU = REPO / "docker-compose.gpu.yml"
COMPOSE_TLS = REPO / "docker-compose.tls.yml"
COMPOSE_DP = REPO / "docker-compose.dp.yml"
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "The three primary colors are",
    "In 1969, Neil Armstrong",
    "A haiku about autumn:",
    "The quick brown fox",
    "To make a cup of tea, first",
    "Water boils at",
    "The largest planet in the solar system is",
    "import numpy as np\n",
    "Once upon a time",
    "The French word for cat is",
    "Machine learning is",
    "The opposite of hot is",
    "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n",
]


def compose(path=COMPOSE) -> dict:
    return yaml.safe_load(path.read_text())


def test_compose_structure():
    doc = compose()
    worker, scheduler = doc["services"]["worker"], doc["services"]["scheduler"]
    assert worker["command"][0] == "worker" and scheduler["command"][0] == "scheduler"
    assert scheduler["depends_on"]["worker"]["condition"] == "service_healthy"
    # the public ports (gRPC, OpenAI HTTP) are published on the host's loopback unless
    # PAGEWIRE_PUBLISH says otherwise; the worker's never
    assert scheduler["ports"] == ["${PAGEWIRE_PUBLISH:-127.0.0.1}:50051:50051",
                                  "${PAGEWIRE_PUBLISH:-127.0.0.1}:8000:8000"] and "ports" not in worker
    assert scheduler["environment"] == {"PAGEWIRE_API_KEY": "${PAGEWIRE_API_KEY:-}"}
    # both tiers come back when they die; the scheduler runs several API servers
    assert worker["restart"] == scheduler["restart"] == "unless-stopped"
    assert int(scheduler["command"][scheduler["command"].index("--api-servers") + 1]) >= 2
    # a CPU-only host can run the base file: the GPU request lives in the override file
    assert "deploy" not in worker
    gpu_worker = compose(COMPOSE_GPU)["services"]["worker"]
    gpu = gpu_worker["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and gpu["driver"] == "nvidia"
    # the CPU build of torch by default, PyPI's CUDA build (an empty index) with the GPU
    assert worker["build"]["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert gpu_worker["build"]["args"]["TORCH_INDEX"] == ""
    # the scheduler reaches the worker at the address the worker listens on
    worker_port = worker["command"][worker["command"].index("--listen") + 1].rsplit(":", 1)[1]
    assert scheduler["command"][scheduler["command"].index("--worker") + 1] == f"worker:{worker_port}"
    assert (REPO / "Dockerfile").is_file()


def test_every_compose_command_is_a_valid_command_line():
    from pagewire.cli import build_parser

    tls = compose(COMPOSE_TLS)["services"]["scheduler"]
    assert "./certs:/certs:ro" in tls["volumes"]
    commands = [service["command"] for doc in (compose(), compose(COMPOSE_TLS), compose(COMPOSE_DP))
                for service in doc["services"].values()]
    for command in commands:
        build_parser().parse_args(command)  # SystemExit on an unknown flag
    args = build_parser().parse_args(tls["command"])
    assert (args.tls_cert_file, args.tls_key_file) == ("/certs/server.crt", "/certs/server.key")
    check = tls["healthcheck"]["test"]
    assert check[check.index("--tls-ca-file") + 1] == args.tls_cert_file


def test_data_parallel_compose_structure():
    """Two engine cores (`pagewire core`), each healthy once its worker is connected, and an API
    server that names both at the addresses they listen on; only the API server's ports are
    published."""
    services = compose(COMPOSE_DP)["services"]
    cores = {name: services[name] for name in ("core-a", "core-b")}
    api = services["api"]
    listens = {}
    for name, core in cores.items():
        assert core["command"][0] == "core" and "ports" not in core and core["restart"] == "unless-stopped"
        listens[name] = core["command"][core["command"].index("--listen") + 1].rsplit(":", 1)[1]
        assert core["healthcheck"]["test"][-2:] == [f"127.0.0.1:{listens[name]}", "pagewire.v1.SchedulerCore"]
        assert core["volumes"] == ["model-cache:/cache"]
    assert api["command"][0] == "api-server" and api["restart"] == "unless-stopped"
    named = api["command"][api["command"].index("--scheduler") + 1]
    assert named == ",".join(f"{name}:{port}" for name, port in listens.items())
    assert {name: dep["condition"] for name, dep in api["depends_on"].items()} == {
        "core-a": "service_healthy", "core-b": "service_healthy"}
    assert api["ports"] == ["${PAGEWIRE_PUBLISH:-127.0.0.1}:50051:50051", "${PAGEWIRE_PUBLISH:-127.0.0.1}:8000:8000"]
    assert api["environment"] == {"PAGEWIRE_API_KEY": "${PAGEWIRE_API_KEY:-}"}


def test_the_docker_build_context_holds_only_what_the_dockerfile_copies():
    rules = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert rules[0] == "*"  # everything out (.venv, .cache, .git: gigabytes), then back in:
    allowed = {rule[1:] for rule in rules if rule.startswith("!")}
    copied = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied.update(line.split()[1:-1])
    assert allowed == copied


def test_docker_compose_config_validates():
    if shutil.which("docker-compose") is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose (Debian package) is missing in CI: .ci/run installs it")
        pytest.skip("docker-compose (Debian package) not installed: apt-get install docker-compose")
    for files in ([COMPOSE], [COMPOSE, COMPOSE_GPU], [COMPOSE, COMPOSE_TLS], [COMPOSE_DP]):
        argv = ["docker-compose", *(a for f in files for a in ("-f", str(f))), "config", "-q"]
        out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
        assert out.returncode == 0, out.stderr


def _localize(command: list[str], ports: dict[str, int]) -> list[str]:
    """Rewrite the compose network's addresses (HOST:PORT, comma-separated lists too) to loopback
    ports; ``ports`` maps a port, or SERVICE:PORT where services share a port, to its loopback port."""
    def one(address: str) -> str:
        host, _, port = address.rpartition(":")
        if host == "0.0.0.0" or host == "worker":
            return f"127.0.0.1:{ports[port]}"
        return f"127.0.0.1:{ports[address]}" if address in ports else address

    return [",".join(one(a) for a in arg.split(",")) if ":" in arg else arg for arg in command]


def _run_healthcheck(test: list[str], ports: dict[str, int]) -> int:
    """Run a compose healthcheck (["CMD", "python", ...]) against the loopback ports."""
    assert test[0] == "CMD"
    argv = [sys.executable if a == "python" else a for a in test[1:]]
    argv = [f"127.0.0.1:{ports[a.rsplit(':', 1)[1]]}" if a.startswith("127.0.0.1:") else a for a in argv]
    return subprocess.run(argv, cwd=REPO).returncode


@pytest.mark.slow
def test_data_parallel_compose_commands_run_as_processes(tmp_path, tiny_model_dir):
    """docker-compose.dp.yml's commands as processes on loopback ports (a tiny model instead of
    the embedded one): both cores take requests through the API server, greedy outputs equal the
    offline engine's."""
    from pagewire import LLM, SamplingParams
    from tests.tiny_models import sample_prompts

    model = tiny_model_dir("llama-gqa")
    services = compose(COMPOSE_DP)["services"]
    core_ports = {name: free_port() for name in ("core-a", "core-b")}
    procs = []
    try:
        for name, port in core_ports.items():
            argv = _localize(services[name]["command"], {"50060": port})
            procs.append(Proc([*argv, "--model", str(model), "--num-threads", "1"], tmp_path / f"{name}.log"))
        for proc in procs:
            proc.wait_for_output("engine core ready", timeout=90)
        ports = {"50051": free_port(), "8000": free_port(),
                 **{f"{name}:50060": port for name, port in core_ports.items()}}
        procs.append(Proc(_localize(services["api"]["command"], ports), tmp_path / "api.log"))
        procs[-1].wait_for_output("api-server ready", timeout=60)
        assert _run_healthcheck(services["api"]["healthcheck"]["test"], ports) == 0
        for name, port in core_ports.items():
            assert _run_healthcheck(services[name]["healthcheck"]["test"], {"50060": port}) == 0
        prompts = sample_prompts(model, n=8)
        s = stub(f"127.0.0.1:{ports['50051']}")
        from concurrent.futures import ThreadPoolExecutor

        def one(p):
            return [t for r in s.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=8)))
                    for t in r.token_ids]

        with ThreadPoolExecutor(8) as pool:
            streamed = list(pool.map(one, prompts))
        offline = LLM(model).generate(prompts, SamplingParams(temperature=0, max_tokens=8))
        assert streamed == [o.token_ids for o in offline]
        assert [c.core for c in s.GetLoads(pb.LoadsRequest()).cores] == [0, 1]
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.mark.slow
def test_compose_commands_run_as_processes(tmp_path, smollm2_dir):
    doc = compose()
    worker_cmd, sched_cmd = doc["services"]["worker"]["command"], doc["services"]["scheduler"]["command"]
    ports = {"50052": free_port(), "50051": free_port(), "8000": free_port()}
    worker = Proc(_localize(worker_cmd, ports), tmp_path / "worker.log")
    scheduler = None
    try:
        worker.wait_for_output("worker ready", timeout=180)
        assert _run_healthcheck(doc["services"]["worker"]["healthcheck"]["test"], ports) == 0
        scheduler = Proc(_localize(sched_cmd, ports), tmp_path / "scheduler.log")
        scheduler.wait_for_output("scheduler ready", timeout=60)
        assert _run_healthcheck(doc["services"]["scheduler"]["healthcheck"]["test"], ports) == 0
        # SmolLM2 over gRPC, 16 concurrent streams: equal to the offline API and to transformers
        from concurrent.futures import ThreadPoolExecutor

        from pagewire import LLM, SamplingParams
        from tests.test_parity import hf_greedy

        s = stub(f"127.0.0.1:{ports['50051']}")

        def one(text):
            responses = list(s.Generate(pb.GenerateRequest(prompt=text, sampling=sampling(max_tokens=16)), timeout=120))
            return [t for r in responses for t in r.token_ids], "".join(r.text for r in responses)

        with ThreadPoolExecutor(16) as pool:
            streamed = list(pool.map(one, SMOLLM2_PROMPTS))
        llm = LLM(None)
        offline = llm.generate(SMOLLM2_PROMPTS, SamplingParams(temperature=0, max_tokens=16))
        assert [ids for ids, _ in streamed] == [o.token_ids for o in offline]
        assert [text for _, text in streamed] == [o.text for o in offline]
        # the OpenAI door on the compose port answers with the same text
        import openai

        http = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['8000']}/v1", api_key="unused", max_retries=0)
        out = http.completions.create(model=http.models.list().data[0].id, prompt=SMOLLM2_PROMPTS[0],
                                      max_tokens=16, temperature=0)
        assert out.choices[0].text == streamed[0][1]
        eos = set(llm.engine.worker_info.eos_token_ids)
        for text, (ids, _) in list(zip(SMOLLM2_PROMPTS, streamed))[:4]:
            assert ids == hf_greedy(smollm2_dir, llm.tokenizer.encode(text), 16, eos)[0]
    finally:
        if scheduler:
            scheduler.stop()
        worker.stop()


def test_the_image_default_command_listens_on_all_interfaces_on_the_ports_it_exposes():
    """`docker run -p 50051:50051 -p 8000:8000 IMAGE` reaches both doors: each address the default
    command listens on is 0.0.0.0 (a container's loopback is not published) on an exposed port."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    (cmd,) = [json.loads(line[len("CMD "):]) for line in lines if line.startswith("CMD ")]
    (expose,) = [line.split()[1:] for line in lines if line.startswith("EXPOSE ")]
    addresses = [cmd[cmd.index(flag) + 1] for flag in ("--listen", "--http-listen")]
    for address in addresses:
        host, _, port = address.rpartition(":")
        assert host == "0.0.0.0" and port in expose, (address, expose)
