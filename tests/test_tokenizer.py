"""Scheduler-side tokenizer, chat template and incremental detokenizer."""

from __future__ import annotations

import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from scheduler_svc.api.tokenizer import IncrementalDetokenizer, OffloadedTokenizer, Tokenizer, _bytes_to_unicode


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir("llama-gqa"))


def stream(tok: Tokenizer, prompt: list[int], output: list[int], stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer.for_prompt(tok, len(prompt), stop)
    ids = list(prompt)
    deltas = []
    for i, t in enumerate(output):
        ids.append(t)
        deltas.append(detok.update(ids, is_final=i == len(output) - 1))
    return deltas, detok


def test_multibyte_characters_split_across_tokens(tok):
    text = "héllo wörld — 日本語 🙂!"
    ids = tok.encode(text)
    prompt = tok.encode("Say: ")
    deltas, _ = stream(tok, prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_single_byte_tokens_hold_back_incomplete_characters(tok):
    # force one token per byte through the byte-level alphabet
    vocab = tok._tok.get_vocab()
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_sym = _bytes_to_unicode()
    text = "日本 🙂"
    ids = [vocab[byte_to_sym[b]] for b in text.encode()]
    assert all(byte_to_sym[b] in alphabet for b in text.encode())
    deltas, _ = stream(tok, [5, 6], ids)
    assert "".join(deltas) == text
    assert deltas[0] == "" and deltas[1] == "" and deltas[2] == "日"


def test_stop_string_is_cut_and_held_back(tok):
    ids = tok.encode("the cat sat on the mat. END and more")
    deltas, detok = stream(tok, [5], ids, stop=("END",))
    assert "".join(deltas) == "the cat sat on the mat. "
    assert detok.stopped
    # nothing after the stop string was ever emitted, even partially
    assert all("E" not in d for d in deltas)


def test_text_that_only_looks_like_a_stop_prefix_is_released(tok):
    ids = tok.encode("an ENDless story")
    deltas, detok = stream(tok, [5], ids, stop=("END.",))
    assert "".join(deltas) == "an ENDless story" and not detok.stopped


def test_chat_template(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert "<|im_start|>user\nhi<|im_end|>" in prompt and prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def test_byte_level_fast_path_equals_generic_decode(tok, tiny_model_dir):
    """The byte table path and the decode-window path give identical deltas, including for
    random token soup (invalid UTF-8 and special tokens mixed in)."""
    import random

    assert tok.token_bytes is not None
    generic = Tokenizer(tiny_model_dir("llama-gqa"))
    generic.token_bytes = None
    rng = random.Random(7)
    for trial in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        fast, _ = stream(tok, [5, 6, 7], ids)
        slow, _ = stream(generic, [5, 6, 7], ids)
        assert "".join(fast) == tok.decode(ids) == "".join(slow), ids


def test_ids_of_a_padded_vocabulary_past_the_tokenizer_make_no_text(tok, tiny_model_dir):
    """A model's embedding often has more rows than its tokenizer has tokens (a vocabulary padded
    to a multiple of 64 or 128), and sampling may pick such a row: it decodes to no text, on every
    path, as the tokenizer's own decode skips it."""
    past = [tok.vocab_size, tok.vocab_size + 3]
    ids = tok.encode("the sea") + past[:1] + tok.encode(" is wide") + past[1:]
    generic = Tokenizer(tiny_model_dir("llama-gqa"))
    generic.token_bytes = None
    for tokenizer in (tok, generic):
        deltas, _ = stream(tokenizer, [5, 6, 7], ids)
        assert "".join(deltas) == tok.decode(ids) == "the sea is wide"
        deltas, _ = stream(tokenizer, [5, 6, 7], ids, stop=("zz",))
        assert "".join(deltas) == "the sea is wide"
    detok = IncrementalDetokenizer.for_prompt(tok, 3)
    assert detok.one_token_at_a_time
    assert "".join(detok.next_text(t) for t in ids) == "the sea is wide"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_tokenizer_helper_dies_outright_when_the_thread_that_started_it_ends(tok):
    """The API server starts its tokenizer helper from a thread of the event loop's default
    executor, and the kernel sends the helper SIGTERM when that thread ends (at shutdown), maybe
    while the helper is leaving on its own. It must die on the spot, not raise SystemExit in
    Python's shutdown, where the exception prints a stray traceback into the service's log."""
    offloaded = OffloadedTokenizer(tok)
    try:
        with ThreadPoolExecutor(1) as starter:
            starter.submit(offloaded.warm_up).result()
            helpers = list(offloaded._pool._processes.values())
            assert [h.is_alive() for h in helpers] == [True]
        # the starting thread has ended. The pool's manager thread reaps the dead helper too: a
        # join that loses that race to waitpid returns before the exit code is recorded, so the
        # code is read until it is there
        deadline = time.monotonic() + 10
        for helper in helpers:
            helper.join(10)
            while helper.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
        assert [h.exitcode for h in helpers] == [-signal.SIGTERM]
    finally:
        offloaded.close()


def test_closing_the_tokenizer_helper_waits_for_it(tok):
    """Nothing of the pool is left running after close(): a manager thread still winding down
    at interpreter exit raced ``concurrent.futures``' exit hook (an OSError traceback in the log)."""
    offloaded = OffloadedTokenizer(tok)
    offloaded.warm_up()
    pool = offloaded._pool
    helpers, manager = list(pool._processes.values()), pool._executor_manager_thread
    offloaded.close()
    assert [h.is_alive() for h in helpers] == [False] and not manager.is_alive()
    offloaded.close()  # a second close does nothing


def test_the_core_finds_the_same_eos_id_without_a_tokenizer(tok):
    """The core reads the EOS id from the tokenizer files as plain JSON; it must be the id the API
    servers' tokenizer finds, and None when the config names no EOS token."""
    import json

    from pagewire_common.wire import tokenizer_eos_token_id

    files = tok.files
    assert tok.eos_token_id is not None
    assert tokenizer_eos_token_id(files) == tok.eos_token_id
    # an EOS that is an ordinary vocabulary entry, not an added token
    vocab_token, vocab_id = next(iter(json.loads(files["tokenizer.json"])["model"]["vocab"].items()))
    config = {**json.loads(files["tokenizer_config.json"]), "eos_token": vocab_token}
    changed = {**files, "tokenizer_config.json": json.dumps(config).encode()}
    assert tokenizer_eos_token_id(changed) == Tokenizer.from_files(changed).eos_token_id == vocab_id
    config.pop("eos_token")
    assert tokenizer_eos_token_id({**files, "tokenizer_config.json": json.dumps(config).encode()}) is None
