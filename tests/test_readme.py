"""The README's commands, run as written against the embedded model (served as `make serve`
serves it), print what the README shows."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.service_utils import REPO, Proc, free_port

pytestmark = pytest.mark.slow

README = (REPO / "README.md").read_text()
README_ADDR = "127.0.0.1:50051"
README_HTTP = "http://127.0.0.1:8000"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def console_examples() -> list[tuple[str, str]]:
    """(command, the output the README shows under it) for every `$ pagewire ...` line."""
    examples = []
    for block in code_blocks("console"):
        for part in re.split(r"^\$ ", block, flags=re.M)[1:]:
            command, _, output = part.partition("\n")
            if command.startswith("pagewire "):
                examples.append((command, output.rstrip("\n")))
    return examples


def python_example(marker: str) -> str:
    (code,) = [block for block in code_blocks("python") if marker in block]
    return code


def test_the_readme_keeps_its_first_two_commands_and_shows_examples():
    first = code_blocks("bash")[0].splitlines()
    assert [line.split()[:2] for line in first[:2]] == [["make", "serve"], ["make", "test"]]
    commands = [command for command, _ in console_examples()]
    assert len(commands) >= 3 and all(command.startswith("pagewire generate ") for command in commands)
    assert any("--chat" in c for c in commands) and any("--temperature" in c and "--seed" in c for c in commands)


@pytest.fixture(scope="module")
def served_addrs(smollm2_dir, tmp_path_factory):
    """The embedded model, served as `make serve` does (only the addresses differ): gRPC, HTTP."""
    addr, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = Proc(["serve", "--listen", addr, "--http-listen", http], tmp_path_factory.mktemp("readme") / "serve.log")
    proc.wait_for_output("pagewire ready: serving SmolLM2-135M-Instruct", timeout=300)
    yield addr, f"http://{http}"
    proc.stop(30)


@pytest.fixture(scope="module")
def served(served_addrs):
    return served_addrs[0]


@pytest.mark.parametrize("command, shown", console_examples())
def test_each_console_example_prints_what_the_readme_shows(served, command, shown):
    argv = shlex.split(command)
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", *argv[1:], "--addr", served], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip("\n") == shown, f"`{command}` printed:\n{out.stdout}"


def test_the_python_client_example_streams_the_greedy_completion(served):
    code = python_example("GenerationStub").replace(README_ADDR, served)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the same prompt and length as the first console example, greedy too
    prompt = re.search(r'prompt="([^"]+)"', code).group(1)
    max_tokens = int(re.search(r"max_tokens=(\d+)", code).group(1))
    (shown,) = [shown for command, shown in console_examples()
                if shlex.split(command)[2] == prompt and f"--max-tokens {max_tokens}" in command]
    text, _, usage = out.stdout.partition("\n[")
    assert text == shown
    assert usage.startswith("LENGTH]") and f"completion_tokens: {max_tokens}" in usage


def test_the_offline_example_runs(smollm2_dir):
    out = subprocess.run([sys.executable, "-c", python_example("from pagewire import LLM")], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.rstrip().endswith((" length 0", " stop 0")) and len(out.stdout.split()) > 3, out.stdout


def test_the_openai_sdk_example_streams_what_the_grpc_chat_gives(served_addrs):
    addr, http = served_addrs
    code = python_example("from openai import OpenAI")
    assert README_HTTP in code
    out = subprocess.run([sys.executable, "-c", code.replace(README_HTTP, http)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # the same chat, greedy and as long, through the gRPC door
    question = re.search(r'"content": "([^"]+)"', code).group(1)
    max_tokens = re.search(r"max_tokens=(\d+)", code).group(1)
    grpc_out = subprocess.run([sys.executable, "-m", "pagewire.cli", "generate", question, "--chat", "--max-tokens",
                               max_tokens, "--addr", addr], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert grpc_out.returncode == 0, grpc_out.stderr
    assert out.stdout.strip() and out.stdout.rstrip("\n") == grpc_out.stdout.rstrip("\n")
