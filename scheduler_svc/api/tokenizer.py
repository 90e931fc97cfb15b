"""Tokenizer, chat template and incremental detokenizer for the scheduler.

Built on the ``tokenizers`` library and jinja2 directly (not ``transformers``) so the scheduler
starts fast and never imports torch.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from pagewire_common.chat_template import ChatOptions, compile_chat_template, cut_at_mark, mark_final_message
from pagewire_common.wire import TOKENIZER_FILES
from scheduler_svc.api.stop_strings import StopMatcher, StopStrings


def _token_content(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return str(value)


class Tokenizer:
    """Encode prompts, decode outputs and render chat messages for one model directory."""

    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}: pagewire needs a fast tokenizer file")
        files = {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}
        self._init_from_files(files)

    @classmethod
    def from_files(cls, files: dict[str, bytes], chat_template: str | None = None) -> "Tokenizer":
        """From the tokenizer files by name (as the worker's ``Info`` carries them);
        ``chat_template`` (``--chat-template``'s text) replaces the model's own."""
        if "tokenizer.json" not in files:
            raise FileNotFoundError("no tokenizer.json among the model's files: pagewire needs a fast tokenizer file")
        tok = cls.__new__(cls)
        tok._init_from_files(files)
        if chat_template is not None:
            tok.chat_template = chat_template
        return tok

    @property
    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def _init_from_files(self, files: dict[str, bytes]) -> None:
        self._files = {Path(name).name: data for name, data in files.items()}
        self._tok = _HFTokenizer.from_str(self._files["tokenizer.json"].decode())
        config: dict = {}
        if "tokenizer_config.json" in self._files:
            config = json.loads(self._files["tokenizer_config.json"])
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        template = config.get("chat_template")
        if template is None and "chat_template.jinja" in self._files:
            template = self._files["chat_template.jinja"].decode()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template
        self._compiled_template = None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # decode all-special ids in one set lookup
        self.special_token_ids = frozenset(
            tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )
        self.token_bytes: list[bytes] | None = _byte_level_table(self._tok, self.special_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            template: str | None = None, continue_final_message: bool = False) -> str:
        """Render role/content messages with the model's chat template (or ``template``, a
        template's text) into prompt text, ending as ``ChatOptions`` says."""
        ChatOptions(add_generation_prompt, continue_final_message)  # checks the pair
        if template is None and not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
                raise ValueError("every chat message needs a non-empty role")
            if not isinstance(m.get("content"), str):
                raise ValueError("every chat message needs string content")
        if template is not None:
            compiled = compile_chat_template(template)
        else:
            if self._compiled_template is None:
                self._compiled_template = compile_chat_template(self.chat_template)
            compiled = self._compiled_template
        rendered = compiled.render(
            messages=mark_final_message(messages) if continue_final_message else messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return cut_at_mark(rendered, messages[-1]["content"]) if continue_final_message else rendered


def _bytes_to_unicode() -> dict[int, str]:
    """The byte <-> printable character table of byte-level BPE (GPT-2's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_table(tok: _HFTokenizer, special_ids: frozenset[int]) -> list[bytes] | None:
    """Each token id's raw bytes (b"" for special tokens, which decoding skips), when the
    tokenizer decodes by plain byte-level mapping; None otherwise (then the generic path runs)."""
    spec = json.loads(tok.to_str())
    decoder = spec.get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    table: list[bytes] = [b""] * tok.get_vocab_size(with_added_tokens=True)
    for token, tid in tok.get_vocab(with_added_tokens=True).items():
        if tid >= len(table):
            return None
        if tid in special_ids:
            continue
        try:
            table[tid] = bytes(char_to_byte[c] for c in token)
        except KeyError:  # a token outside the byte alphabet (an unusual added token)
            return None
    return table


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level tokenizers take the fast path: each new token's bytes go through an incremental
    UTF-8 decoder, which holds back a character split across tokens until it is complete
    (``decode`` of the whole list gives the same text). Other tokenizers decode a short window
    of already-emitted tokens plus the new ones and emit the suffix, holding back a trailing
    U+FFFD ("not yet"). Text that might be the start of a stop string is held back too, and a
    completed stop string is cut with all that follows (``include_stop``: what follows it): each
    new character is one step of the stop strings' automaton (``stop_strings.py``), whatever
    their number.
    """

    tokenizer: Tokenizer
    prefix_offset: int
    read_offset: int
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # a stop string found stays at the end of the text
    text: str = ""  # output text decoded so far (stop string not cut yet); the byte path without stop strings keeps none
    num_emitted_chars: int = 0
    stopped: bool = False
    _utf8: codecs.IncrementalDecoder | None = field(default=None, repr=False)
    _stop_matcher: StopMatcher | None = field(default=None, repr=False)

    @classmethod
    def for_prompt(cls, tokenizer: Tokenizer, num_prompt_tokens: int, stop: tuple[str, ...] = (),
                   stop_strings: StopStrings | None = None, include_stop: bool = False):
        """``stop_strings``: the automaton of ``stop``, when the caller shares one between the
        samples of a request; built here otherwise. ``include_stop``: the text ends with the stop
        string found rather than before it."""
        # a few prompt tokens of context make the first output tokens decode as they will in full
        detok = cls(tokenizer, max(num_prompt_tokens - 5, 0), num_prompt_tokens, tuple(stop), include_stop)
        if tokenizer.token_bytes is not None:
            detok._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if stop:
            detok._stop_matcher = StopMatcher(stop_strings if stop_strings is not None else StopStrings(stop))
        return detok

    @property
    def one_token_at_a_time(self) -> bool:
        """Whether ``next_text`` serves: the byte path, no stop strings."""
        return self._utf8 is not None and self._stop_matcher is None

    def next_text(self, token_id: int) -> str:
        """``update`` of one more token (not the last) where ``one_token_at_a_time``: its bytes
        through the UTF-8 decoder, no list or text kept."""
        self.read_offset += 1
        try:
            return self._utf8.decode(self.tokenizer.token_bytes[token_id])
        except IndexError:  # an id of the model's padded vocabulary, past the tokenizer's
            return ""

    def update(self, token_ids: list[int], is_final: bool, may_stop: bool = True) -> str:
        """Feed the full token list after new tokens arrived; return the text to stream now.
        ``may_stop`` False (the request's ``min_tokens`` not reached yet): a stop string completed
        by these tokens does not stop it, and only one that ends in later text will."""
        if self.stopped:
            return ""
        if self._utf8 is not None:
            table = self.tokenizer.token_bytes
            try:
                new_bytes = b"".join([table[t] for t in token_ids[self.read_offset :]])
            except IndexError:  # ids of the model's padded vocabulary, past the tokenizer's: no text
                size = len(table)
                new_bytes = b"".join([table[t] for t in token_ids[self.read_offset :] if t < size])
            self.read_offset = len(token_ids)
            if self._stop_matcher is None:
                return self._utf8.decode(new_bytes, final=is_final)
            self.text += self._utf8.decode(new_bytes, final=is_final)
        else:
            prefix_text = self.tokenizer.decode(token_ids[self.prefix_offset : self.read_offset])
            new_text = self.tokenizer.decode(token_ids[self.prefix_offset :])
            if len(new_text) > len(prefix_text) and (is_final or not new_text.endswith("\ufffd")):
                self.text += new_text[len(prefix_text) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(token_ids)
        matcher = self._stop_matcher
        if matcher is None:
            delta = self.text[self.num_emitted_chars :]
            self.num_emitted_chars = len(self.text)
            return delta
        emit_upto = len(self.text)
        # the text only grows, so the matcher has read exactly its first num_chars characters
        hit = matcher.feed(self.text[matcher.num_chars :])
        if hit is not None and may_stop:
            self.stopped = True
            if self.include_stop:
                hit += matcher.match_length
            self.text = self.text[:hit]
            emit_upto = hit
        elif not is_final:
            # hold back a tail that could still grow into a stop string
            emit_upto = len(self.text) - matcher.num_held
        emit_upto = max(emit_upto, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars : emit_upto]
        self.num_emitted_chars = emit_upto
        return delta


# ---- tokenizing off the event loop ----------------------------------------------------------------

# Texts up to this many characters are tokenized inline (about a millisecond); longer ones in a
# helper process. ``tokenizers`` holds the GIL while it encodes, so a thread would not help: a
# 1 MB prompt takes over a second, during which no other stream of the process would move.
INLINE_CHARS = 4096
_pool_tokenizer: Tokenizer | None = None


def _pool_init(files: dict[str, bytes], chat_template: str | None, parent_pid: int) -> None:
    global _pool_tokenizer
    from pagewire_common.supervisor import die_with_parent

    # a hard kill of the API server takes its helper down too; so does the end of the thread that
    # started it (the event loop's default executor, at shutdown), which can come while the helper
    # is leaving on its own: SIGTERM kills it outright, with nothing to unwind
    die_with_parent(parent_pid, unwind=False)
    _pool_tokenizer = Tokenizer.from_files(files, chat_template)


def _pool_encode(text: str) -> list[int]:
    return _pool_tokenizer.encode(text)


def _encode_chat(tokenizer: Tokenizer, messages: list[dict[str, str]], options: ChatOptions) -> tuple[str, list[int]]:
    prompt = tokenizer.apply_chat_template(messages, options.add_generation_prompt,
                                           continue_final_message=options.continue_final_message)
    return prompt, tokenizer.encode(prompt)


def _pool_chat(messages: list[dict[str, str]], options: ChatOptions) -> tuple[str, list[int]]:
    return _encode_chat(_pool_tokenizer, messages, options)


def _pool_decode(token_ids: list[int]) -> str:
    return _pool_tokenizer.decode(token_ids)


class OffloadedTokenizer:
    """Encodes prompts, renders chat templates and decodes ids without stalling the caller's event
    loop: small inputs inline, large ones in one helper process (started on first use)."""

    def __init__(self, tokenizer: Tokenizer, inline_chars: int = INLINE_CHARS):
        self.tokenizer = tokenizer
        self.inline_chars = inline_chars
        self._pool = None

    def _executor(self):
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_pool_init, initargs=(self.tokenizer.files, self.tokenizer.chat_template, os.getpid()),
            )
        return self._pool

    def warm_up(self) -> None:
        """Start the helper process now (it takes a fraction of a second), not at the first big prompt."""
        self._executor().submit(_pool_encode, "warm up").result()

    async def encode(self, text: str) -> list[int]:
        if len(text) <= self.inline_chars:
            return self.tokenizer.encode(text)
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._executor(), _pool_encode, text)

    async def encode_chat(self, messages: list[dict[str, str]],
                          options: ChatOptions = ChatOptions()) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids (``ValueError`` for a bad template or message)."""
        if sum(len(m.get("content") or "") for m in messages) <= self.inline_chars:
            return _encode_chat(self.tokenizer, messages, options)
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._executor(), _pool_chat, messages, options)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (special tokens skipped); ids that make about as much text as
        ``inline_chars`` (four characters a token) are decoded inline."""
        if len(token_ids) <= self.inline_chars // 4:
            return self.tokenizer.decode(token_ids)
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(self._executor(), _pool_decode, token_ids)

    def close(self) -> None:
        """Stop the helper and wait for it (tens of milliseconds; longer only if it is encoding).
        Left to finish in the background, the pool's manager thread could close its wake-up pipe
        while interpreter exit wrote to it: a stray ``OSError`` traceback in the log."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
