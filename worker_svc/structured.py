"""Structured output: grammar token masks (placeholder until the grammar library is wired)."""

from __future__ import annotations


class GrammarMasks:
    pass
