"""The tiny trained test models (tests/tiny_models.py) load, are trained, and decode sensibly.

The first run builds the three models into <repo>/.cache/tiny-models/ (a few seconds each);
later runs reuse them.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import pytest

from tests import tiny_models as tm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Measured full-text losses (ln(512) = 6.24): gpt2 0.38, llama-gqa 0.09, qwen2-bias 0.12, qwen3 0.12.
MAX_TEXT_LOSS = {"gpt2": 1.2, "llama-gqa": 0.6, "qwen2-bias": 0.6, "qwen3": 0.6}
# Measured median top-2 logit margins at greedy steps: gpt2 3.1, llama-gqa 5.8, qwen2-bias 5.1.
MIN_MEDIAN_MARGIN = 0.75

MULTIBYTE = "héllo wörld — 日本語 🙂"
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=tm.TINY_KINDS)
def tiny(request):
    kind = request.param
    path = tm.get_tiny_model(kind)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return kind, path, tok, model


@pytest.fixture(scope="module")
def generations(tiny):
    """Greedy continuations of the sample prompts, with the top-2 logit margin at each step."""
    _, path, _, model = tiny
    out = []
    for prompt in tm.sample_prompts(path):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            res = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                output_scores=True,
                return_dict_in_generate=True,
            )
        cont = res.sequences[0, len(prompt) :].tolist()
        margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in res.scores]
        out.append((prompt, cont, margins))
    return out


def test_directory_loads(tiny):
    kind, path, tok, model = tiny
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (path / name).is_file(), name
    assert path.name == f"{kind}-v{tm.VERSION}"
    assert tok.is_fast
    expected_eos = "<|endoftext|>" if kind == "gpt2" else "<|im_end|>"
    assert tok.eos_token == expected_eos
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids(expected_eos)
    assert model.config.pad_token_id == tok.pad_token_id == 0
    assert model.config.vocab_size == len(tok) == tm.VOCAB_SIZE
    assert model.dtype == torch.float32
    assert model.generation_config.do_sample is False
    assert model.config.model_type == {"gpt2": "gpt2", "llama-gqa": "llama", "qwen2-bias": "qwen2", "qwen3": "qwen3"}[kind]
    if kind == "llama-gqa":
        assert model.config.num_key_value_heads == 2 < model.config.num_attention_heads
        assert not model.config.tie_word_embeddings
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    if kind == "qwen2-bias":
        assert model.config.tie_word_embeddings
        assert model.model.layers[0].self_attn.q_proj.bias is not None
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if kind == "qwen3":
        # head_dim apart from hidden // heads, one KV head (replicated over tensor-parallel ranks)
        assert model.config.head_dim * model.config.num_attention_heads != model.config.hidden_size
        assert model.config.num_key_value_heads == 1
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (model.config.head_dim,)


def test_special_tokens_and_chat_template(tiny):
    _, _, tok, _ = tiny
    for i, t in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>")):
        assert tok.convert_tokens_to_ids(t) == i
        assert tok.encode(t, add_special_tokens=False) == [i]
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tokenizer_round_trips_utf8(tiny):
    _, path, tok, _ = tiny
    raw = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in (MULTIBYTE, tm.FIXED_TEXT, "  leading spaces\ttabs\nand \r\n newlines ", "a"):
        ids = raw.encode(text).ids
        assert raw.decode(ids) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # Byte-level: unseen characters still encode (as byte tokens), never as an unknown token.
    assert len(raw.encode(MULTIBYTE).ids) >= len(MULTIBYTE)


def test_training_worked(tiny):
    kind, path, _, model = tiny
    raw = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    loss = tm.text_loss(model, raw.encode(tm.FIXED_TEXT).ids)
    assert loss < MAX_TEXT_LOSS[kind] < math.log(tm.VOCAB_SIZE) / 4, loss


def test_greedy_depends_on_context(tiny, generations):
    conts = [tuple(c) for _, c, _ in generations]
    assert len(generations) >= 4
    assert len(set(conts)) >= 3, conts
    for c in conts:
        assert len(c) == NEW_TOKENS  # never emitted eos (not in the training text)
        assert len(set(c)) > 1, c  # not one token repeated


def test_no_near_ties(tiny, generations):
    margins = [m for _, _, ms in generations for m in ms]
    assert statistics.median(margins) > MIN_MEDIAN_MARGIN, statistics.median(margins)


def test_sample_prompts(tiny):
    _, path, _, _ = tiny
    prompts = tm.sample_prompts(path)
    assert [len(p) for p in prompts] == [1, 3, 9, 17, 33, 50, 77, 120]
    assert prompts == tm.sample_prompts(path)  # deterministic
    assert all(0 <= t < tm.VOCAB_SIZE for p in prompts for t in p)
    # Some windows of the training text, some off-distribution.
    in_ids = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).encode(tm.FIXED_TEXT).ids
    in_text = ",".join(map(str, in_ids))
    inside = [",".join(map(str, p)) in in_text for p in prompts if len(p) >= 9]
    assert any(inside) and not all(inside)
    lengths = [len(p) for p in tm.sample_prompts(path, n=12)]
    assert len(lengths) == 12 and min(lengths) == 1 and max(lengths) >= 100
    assert len(set(lengths)) == 12


def test_get_tiny_model_is_cached(tiny):
    kind, path, _, _ = tiny
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    dir_mtime = path.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = tm.get_tiny_model(kind)
    assert time.perf_counter() - t0 < 1.0
    assert again == path
    assert path.stat().st_mtime_ns == dir_mtime
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    assert path.parent == tm.CACHE_DIR
    assert not [p for p in tm.CACHE_DIR.iterdir() if ".tmp-" in p.name and p.name.startswith(f".{path.name}")]


def _fake_build(calls):
    def build(kind, out_dir):
        calls.append(Path(out_dir))
        (Path(out_dir) / "config.json").write_text("{}")
        return Path(out_dir)

    return build


def test_cache_builds_once_atomically(tmp_path, monkeypatch):
    """Build goes to a temp dir, is renamed into place, and is reused (no real training)."""
    calls: list[Path] = []
    monkeypatch.setattr(tm, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(tm, "build_tiny_model", _fake_build(calls))
    first = tm.get_tiny_model("gpt2")
    assert first == tmp_path / "cache" / f"gpt2-v{tm.VERSION}"
    assert (first / "config.json").is_file()
    assert len(calls) == 1 and calls[0] != first and calls[0].parent == first.parent
    assert tm.get_tiny_model("gpt2") == first
    assert len(calls) == 1
    left = sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock"))
    assert left == [first.name]  # no temp dir left behind
    with pytest.raises(ValueError):
        tm.get_tiny_model("nope")


def test_cache_lost_race_uses_winner(tmp_path, monkeypatch):
    """If another process renames its build into place first, ours is discarded."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(tm, "CACHE_DIR", cache)
    final = cache / f"llama-gqa-v{tm.VERSION}"

    def racing_build(kind, out_dir):
        (Path(out_dir) / "config.json").write_text('{"ours": true}')
        final.mkdir()
        (final / "config.json").write_text('{"winner": true}')
        return Path(out_dir)

    monkeypatch.setattr(tm, "build_tiny_model", racing_build)
    assert tm.get_tiny_model("llama-gqa") == final
    assert "winner" in (final / "config.json").read_text()
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) == [final.name]


def test_cache_dir_is_git_ignored():
    assert tm.REPO_ROOT == Path(__file__).resolve().parent.parent
    if "PAGEWIRE_TINY_MODELS_DIR" not in os.environ:
        assert tm.CACHE_DIR == tm.REPO_ROOT / ".cache" / "tiny-models"
    gitignore = tm.REPO_ROOT / ".gitignore"
    if gitignore.is_file():
        assert ".cache/" in gitignore.read_text().split()
