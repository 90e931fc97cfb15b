"""Tiny, briefly trained Hugging Face models for parity tests.

Randomly initialised tiny models tend to repeat a single token and have many near-ties between
the top logits, which hides attention and position bugs in a serving engine. The models built
here are trained for a few seconds on :data:`FIXED_TEXT` (next-token prediction), so their greedy
continuations depend on the context and the top choice usually wins by a clear margin.

Public API::

    TINY_KINDS                          # ("gpt2", "llama-gqa", "qwen2-bias", "qwen3")
    build_tiny_model(kind, out_dir)     # build a complete HF model directory (deterministic)
    get_tiny_model(kind)                # cached build under <repo>/.cache/tiny-models/
    sample_prompts(tokenizer_dir, n=8)  # deterministic prompts (token-id lists), lengths 1..120
    FIXED_TEXT                          # the training text

Each model directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``,
``tokenizer.json`` and ``tokenizer_config.json`` (eos/bos/pad tokens and a ChatML
``chat_template``), and loads with ``AutoModelForCausalLM`` / ``AutoTokenizer``.

Bump :data:`VERSION` whenever anything that changes the built files changes (text, tokenizer,
configs, training): it is part of the cache path, so the next run rebuilds.

Plain module (no pytest imports): imported by tests and by conftest files.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

VERSION = "1"

TINY_KINDS = ("gpt2", "llama-gqa", "qwen2-bias", "qwen3")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Overridable (e.g. a shared CI cache); defaults to the git-ignored <repo>/.cache/tiny-models.
CACHE_DIR = Path(os.environ.get("PAGEWIRE_TINY_MODELS_DIR", REPO_ROOT / ".cache" / "tiny-models"))

VOCAB_SIZE = 512
MAX_POSITIONS = 256
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training hyper-parameters. Measured on an idle 2-core CPU: ~5-7 s per model (300 steps of
# 4 x 256 tokens); a busy machine can make it several times slower (OpenMP spin-waits).
TRAIN_SEED = 1234
# Windows span every position up to MAX_POSITIONS: GPT-2's learned position embeddings are
# garbage at positions it never trained on (64-token windows left positions 64+ untrained).
TRAIN_STEPS = 300
TRAIN_BATCH = 4
TRAIN_SEQ_LEN = MAX_POSITIONS
TRAIN_LR = 5e-3

FIXED_TEXT = """\
The lighthouse keeper woke before dawn, as he had done for thirty years. He climbed the \
spiral stairs with a lantern in one hand and a cup of black coffee in the other, counting \
the steps out of habit: one hundred and twelve. At the top he wiped the salt from the glass \
and watched the grey line of the horizon slowly turn to silver.

Bread is mostly patience. Mix flour, water, salt and a little yeast, then leave the dough \
alone for a long time. The yeast eats the sugars and breathes out gas, and the gluten \
stretches to hold it. A cold kitchen only slows the rise; it does not stop it. Bake the \
loaf in a very hot oven until the crust sounds hollow when you knock on it.

In the spring the river rose above its banks and covered the low meadow. Herons stood in \
the shallow water like grey umbrellas, and the children counted frogs from the old stone \
bridge. By June the water had gone back to its bed, leaving a line of dry reeds along the \
fence and a smell of mud that lasted all summer.

A computer does exactly what it is told, which is not always what you meant. When a program \
fails, read the error message slowly, from the first line to the last. Print the values you \
are unsure about. Change one thing at a time, and write down what you tried, because the \
bug you fixed yesterday may come back tomorrow wearing a different hat.

Maria kept a small notebook in her coat pocket. On the train she wrote down the names of \
stations, the colours of umbrellas, and the strange things strangers said on the phone. \
"Tell the dentist I am a pirate now," one man said, very seriously, and then he got off at \
the next stop. She underlined that sentence twice.

The market opened at seven. Farmers unloaded crates of apples, pears, cabbages and eggs, \
while the baker arranged warm rolls in careful rows. An old woman sold honey in glass jars \
and told everyone that her bees preferred lavender to clover. Nobody argued with her; the \
honey was too good.

Mountains make their own weather. A clear morning can turn into a storm before lunch, so \
experienced walkers carry a warm layer, a map, water and something to eat, even on a short \
trip. If the clouds come down and you cannot see the path, stop, check the map, and walk \
back the way you came.

The orchestra tuned their instruments while the hall filled with people. First the oboe \
played a long clear A, then the violins answered, then the cellos and the double basses. \
When the conductor lifted her hands, the room became so quiet that you could hear the rain \
on the roof.

Seven small boats left the harbour at noon. The first carried nets, the second carried \
ropes, the third carried barrels of fresh water, and the fourth carried a dog named Biscuit \
who barked at every gull. The last three boats were empty, waiting for the fish.

To make a good cup of tea, warm the pot first. Use fresh water that has just come to the \
boil, and let the leaves steep for three or four minutes. Milk is a question of taste and \
of long family arguments, which this paragraph will not try to settle.

Numbers tell stories too: 3 cats, 12 chairs, 25 windows, 100 years. In 1969 people walked \
on the moon, and in 1989 a wall fell in Berlin. Count to ten, then count back to zero.

Some words travel well: café, naïve, jalapeño, façade, smörgåsbord and Übermensch. \
In Tokyo the sign said 東京駅, and in Moscow it said Москва. The price was 5 € or £4, \
give or take; the temperature was 21 °C, and she smiled 🙂 at the small café — again.
"""

# Text that is not in FIXED_TEXT, for off-distribution prompts (code, numbers, other scripts).
_OFF_DISTRIBUTION_TEXT = """\
def fibonacci(n: int) -> list[int]:
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]

SELECT id, name, price FROM products WHERE price > 42 ORDER BY name DESC LIMIT 10;
{"user": "zq_47", "items": [3, 1, 4, 1, 5, 9, 2, 6], "ok": true, "ratio": 0.618}
Quantum chromodynamics describes gluons binding quarks inside protons and neutrons.
Der schnelle braune Fuchs springt über den faulen Hund. Ελληνικά γράμματα: α β γ δ.
xkcd zzz qwfp 0x7fff_ffff !!! ??? ### @@@ $$$ %%% ^^^ &&& *** ((( ))) [[[ ]]] {{{ }}}
"""

_DEFAULT_PROMPT_LENGTHS = (1, 3, 9, 17, 33, 50, 77, 120)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _eos_token(kind: str) -> str:
    return "<|endoftext|>" if kind == "gpt2" else "<|im_end|>"


def _train_tokenizer():
    """Byte-level BPE trained on FIXED_TEXT (deterministic), special tokens at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(FIXED_TEXT.splitlines(keepends=True), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok


def _write_tokenizer(tok, kind: str, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    eos = _eos_token(kind)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>" if kind == "gpt2" else None,
        "eos_token": eos,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def _make_config(kind: str, vocab_size: int, eos_id: int):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    pad_id = SPECIAL_TOKENS.index("<|endoftext|>")
    if kind == "gpt2":
        return GPT2Config(
            vocab_size=vocab_size,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=MAX_POSITIONS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=pad_id,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
        )
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if kind == "llama-gqa":
        return LlamaConfig(**common, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if kind == "qwen2-bias":
        # Qwen2 always has q/k/v projection biases (and none on o_proj).
        return Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
    if kind == "qwen3":
        # head_dim stated apart from hidden_size // heads (as in real Qwen3), and one KV head, so
        # that two tensor-parallel ranks each hold a replica of it
        return Qwen3Config(**{**common, "num_key_value_heads": 1}, head_dim=32, tie_word_embeddings=True,
                           use_sliding_window=False)
    raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")


def _train(model, ids, *, steps: int, seed: int) -> float:
    """Next-token prediction on random windows of ``ids``; returns the final full-text loss."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids, dtype=torch.long)
    seq = min(TRAIN_SEQ_LEN, len(ids) - 1)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1.0 - s / steps)
    )
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq, (TRAIN_BATCH,), generator=gen)
        batch = torch.stack([data[s : s + seq] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return text_loss(model, ids)


def text_loss(model, ids, window: int = MAX_POSITIONS - 1) -> float:
    """Mean next-token loss of ``model`` over ``ids`` in consecutive windows (no grad)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[start : start + window + 1]], dtype=torch.long)
            if chunk.shape[1] < 2:
                break
            n = chunk.shape[1] - 1
            total += float(model(input_ids=chunk, labels=chunk).loss) * n
            count += n
    return total / count


def build_tiny_model(kind: str, out_dir: str | Path) -> Path:
    """Create a complete HF model directory at ``out_dir``: config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json (eos token, ChatML chat_template) and
    generation_config.json (greedy). Deterministic (fixed seeds). Returns ``out_dir``."""
    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer()
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id(_eos_token(kind))
    ids = tok.encode(FIXED_TEXT).ids

    config = _make_config(kind, vocab_size, eos_id)
    # Fork the RNG so building a model never disturbs the caller's torch random state.
    # One thread: as fast as two for these sizes, and steady when other work loads the machine
    # (two OpenMP threads contending with another busy process slowed builds from 7 s to 50 s).
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(TRAIN_SEED)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            final_loss = _train(model, ids, steps=TRAIN_STEPS, seed=TRAIN_SEED)
    finally:
        torch.set_num_threads(num_threads)

    model.generation_config = GenerationConfig(
        do_sample=False,
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    _write_tokenizer(tok, kind, out_dir)
    (out_dir / "tiny_model_info.json").write_text(
        json.dumps(
            {"kind": kind, "version": VERSION, "steps": TRAIN_STEPS, "final_text_loss": final_loss},
            indent=2,
        )
        + "\n"
    )
    return out_dir


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive inter-process lock (POSIX flock); a no-op where fcntl is unavailable."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def tiny_model_path(kind: str) -> Path:
    """Where :func:`get_tiny_model` keeps ``kind`` (it may not exist yet)."""
    return CACHE_DIR / f"{kind}-v{VERSION}"


def get_tiny_model(kind: str) -> Path:
    """Return the cached model directory for ``kind``, building it once if needed.

    The build goes into a temporary sibling directory that is renamed into place with
    ``os.replace``, so a directory at the final path is always complete. A lock file makes
    concurrent processes wait for one build instead of duplicating it; if two builds still
    race (no flock), the loser discards its copy and uses the winner's.
    """
    if kind not in TINY_KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; expected one of {TINY_KINDS}")
    final = tiny_model_path(kind)
    if final.is_dir():
        return final
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with _file_lock(CACHE_DIR / f".{final.name}.lock"):
        if final.is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=CACHE_DIR))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is meant to be shared
            build_tiny_model(kind, tmp)
            for f in tmp.iterdir():  # save_pretrained may leave 0600 files
                if f.is_file():
                    os.chmod(f, 0o644)
            try:
                os.replace(tmp, final)
            except OSError:
                if not final.is_dir():  # a real failure, not a lost race
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def _spread_lengths(n: int, max_len: int) -> list[int]:
    """``n`` lengths spread roughly geometrically from 1 to ``max_len``."""
    if n <= 0:
        return []
    if n == 1:
        return [1]
    out = [max(1, round(max_len ** (i / (n - 1)))) for i in range(n)]
    for i in range(1, n):  # strictly increasing where possible
        out[i] = max(out[i], out[i - 1] + 1)
    return out


def sample_prompts(
    tokenizer_dir: str | Path,
    n: int = 8,
    *,
    lengths: list[int] | tuple[int, ...] | None = None,
    seed: int = 0,
    off_distribution_every: int = 3,
) -> list[list[int]]:
    """Deterministic prompts as token-id lists, with lengths spread from 1 to 120 tokens.

    With the default ``n=8`` the lengths are 1, 3, 9, 17, 33, 50, 77, 120; other ``n`` spread
    ``n`` lengths from 1 to 120 (``lengths``, if given, overrides ``n``). Most prompts are
    windows of :data:`FIXED_TEXT` (the model knows what comes next); every
    ``off_distribution_every``-th prompt (index 2, 5, ...) is a window of text the model never
    saw (code, JSON, other scripts). Windows start at random (seeded) token offsets, so they
    may begin mid-word.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    in_ids = tok.encode(FIXED_TEXT).ids
    off_ids = tok.encode(_OFF_DISTRIBUTION_TEXT).ids
    if lengths is None:
        lengths = _DEFAULT_PROMPT_LENGTHS if n == len(_DEFAULT_PROMPT_LENGTHS) else _spread_lengths(n, 120)
    rng = random.Random(seed)
    prompts = []
    for i, length in enumerate(lengths):
        off = off_distribution_every > 0 and i % off_distribution_every == off_distribution_every - 1
        source = off_ids if off else in_ids
        if length > len(source):
            raise ValueError(f"prompt length {length} exceeds the {len(source)}-token source text")
        start = rng.randrange(0, len(source) - length + 1)
        prompts.append(list(source[start : start + length]))
    return prompts


__all__ = [
    "CACHE_DIR",
    "FIXED_TEXT",
    "TINY_KINDS",
    "VERSION",
    "build_tiny_model",
    "get_tiny_model",
    "sample_prompts",
    "text_loss",
    "tiny_model_path",
]
