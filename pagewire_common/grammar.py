"""Structured output grammars: one place that turns ``(kind, text)`` into a grammar and checks it.

Pure Python over llguidance's core (no torch): the API servers check a request's grammar before
queueing it, with the library's own message, and the worker builds its matchers from the same
text.
"""

from __future__ import annotations

import functools

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

# JSON without free whitespace: a weak model cannot loop on spaces or newlines
_JSON_OPTIONS = {"whitespace_flexible": False}


@functools.lru_cache(maxsize=256)
def grammar_of(kind: str, text: str) -> str:
    """The llguidance grammar for a ``SamplingParams.structured_output``; cached by its text.
    ``ValueError`` with the library's message when the schema, regex or grammar is invalid."""
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "grammar":
            if "::=" in text:  # GBNF (llama.cpp); Lark otherwise
                try:
                    text = gbnf_to_lark(text)
                except Exception as e:  # the converter raises bare Exceptions for unknown rules
                    raise ValueError(str(e)) from None
            return llguidance.LLMatcher.grammar_from_lark(text)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"invalid {kind}: {e}") from None
    raise ValueError(f"unknown structured output kind {kind!r}")


@functools.lru_cache(maxsize=256)
def check_grammar(kind: str, text: str) -> None:
    """``ValueError`` with the library's message unless the grammar compiles (cached by text)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_of(kind, text))
    if is_error:
        raise ValueError(f"invalid {kind}: {'; '.join(messages)}")
