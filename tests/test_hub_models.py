"""``--model ORG/NAME`` through ``huggingface_hub``: found in a Hugging Face cache laid out here
(no network), served with the same tokens as the same model loaded by path, and a clear error
when it is not cached and ``HF_HUB_OFFLINE`` is set."""

from __future__ import annotations

import os
import shutil

import pytest

from pagewire import LLM, SamplingParams
from pagewire_common.v1 import generation_pb2 as pb
from tests.service_utils import Proc, free_port, sampling, stub
from worker_svc.hub import is_hub_id
from worker_svc.weights import model_name, resolve_model_path

REPO_ID = "pagewire-tests/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture(scope="module")
def hub_cache(model_dir, tmp_path_factory):
    """A Hugging Face cache holding REPO_ID, laid out as huggingface_hub writes it:
    models--ORG--NAME/refs/main names the snapshot folder under snapshots/."""
    cache = tmp_path_factory.mktemp("hf-hub")
    repo = cache / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache


@pytest.fixture()
def offline_cache(hub_cache, monkeypatch):
    """huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported: set its constants."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub_cache


def test_an_id_is_an_id_only_where_no_such_path_exists(tmp_path, monkeypatch):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_hub_id("org/name.v2")
    for not_an_id in (None, "name", "/abs/path", "./org/name", "a/b/c", "org/model.gguf", "org/"):
        assert not is_hub_id(not_an_id), not_an_id
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # a local directory wins


def test_an_id_resolves_to_its_cached_snapshot_and_keeps_its_name(offline_cache, model_dir):
    snapshot = offline_cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert resolve_model_path(REPO_ID) == snapshot
    assert model_name(REPO_ID, snapshot) == REPO_ID
    assert model_name(str(model_dir), model_dir) == model_dir.name


def test_an_id_that_is_not_cached_is_a_clear_error_when_offline(offline_cache):
    with pytest.raises(FileNotFoundError, match=r"model 'nobody/nothing' is not in the Hugging Face cache \(.*"
                       r"\) and HF_HUB_OFFLINE is set: download it first \(hf download nobody/nothing\)"):
        resolve_model_path("nobody/nothing")


def test_llm_by_id_generates_what_llm_by_path_does(offline_cache, model_dir):
    params = SamplingParams(temperature=0, max_tokens=8)
    by_path = LLM(model_dir, block_size=4, num_kv_blocks=64).generate(PROMPTS, params)
    by_id = LLM(REPO_ID, block_size=4, num_kv_blocks=64)
    assert [o.token_ids for o in by_id.generate(PROMPTS, params)] == [o.token_ids for o in by_path]
    assert by_id.engine.worker_info.model_name == REPO_ID


@pytest.mark.slow
def test_serve_by_id_from_the_cache_offline(hub_cache, model_dir, tmp_path):
    port = free_port()
    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    serve = Proc(["serve", "--model", REPO_ID, "--listen", f"127.0.0.1:{port}", "--block-size", "4",
                  "--num-kv-blocks", "64"], tmp_path / "serve.log", env=env)
    try:
        serve.wait_for_output("pagewire ready", timeout=120)
        s = stub(f"127.0.0.1:{port}")
        served = [[t for r in s.Generate(pb.GenerateRequest(prompt_token_ids=p, sampling=sampling(max_tokens=8)),
                                         timeout=60) for t in r.token_ids] for p in PROMPTS]
        info = s.GetModelInfo(pb.ModelInfoRequest(), timeout=10)
    finally:
        serve.stop()
    expected = LLM(model_dir, block_size=4, num_kv_blocks=64).generate(PROMPTS, SamplingParams(temperature=0,
                                                                                              max_tokens=8))
    assert served == [o.token_ids for o in expected]
    assert info.model_name == REPO_ID
    assert f"pagewire ready: serving {REPO_ID} on" in serve.output()


@pytest.mark.slow
def test_serve_with_an_id_not_in_the_cache_stops_with_the_reason(hub_cache, tmp_path):
    import subprocess
    import sys

    from tests.service_utils import REPO

    env = dict(os.environ, HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1")
    # its own HTTP port too: the default one may be taken by another server on the machine
    out = subprocess.run([sys.executable, "-m", "pagewire.cli", "serve", "--model", "nobody/nothing", "--listen",
                          f"127.0.0.1:{free_port()}", "--http-listen", f"127.0.0.1:{free_port()}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "model 'nobody/nothing' is not in the Hugging Face cache" in out.stderr
    assert "exited with code 2 before it was ready; stopping" in out.stderr and "Traceback" not in out.stderr
