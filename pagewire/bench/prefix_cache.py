"""The shared-prefix workload (``--prefix-groups G --prefix-len L``) and the prefix-cache hit
rate the server reports.

Workload: each run draws G prefixes of L random token ids from ``--seed`` and the run's index
(runs do not share prefixes, so a measured run finds nothing that a warmup left in the cache).
Request ``i`` belongs to group ``i % G`` (round robin: every group's requests are spread over the
whole run) and sends its group's prefix followed by a suffix of its own, ``--prompt-len`` random
ids; no two requests of a run have the same suffix.

Hit rate: the server's own counters (``GetStats``: ``num_prefix_cache_queried_tokens``, prompt
tokens looked up when their requests were first scheduled, and ``num_prefix_cache_hit_tokens``,
those found cached), read before and after each measured run; hit / queried over the difference.
They count every client of the server, so against a shared server the rate includes others' work.

Ideal: the fraction of the run's prompt tokens that lie in full KV blocks of a prefix an earlier
request already sent: ``(n - G) * (L // block_size) * block_size / prompt tokens`` (every request
but the first of its group). Below it: requests of a group sent before the group's first prompt
was computed (all of the first ``--concurrency`` at the start), and evictions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import NamedTuple


def group_of(request_index: int, num_groups: int) -> int:
    """The prefix group of a request: round robin over the groups."""
    return request_index % num_groups


def prefix_group_prompts(
    n: int,
    num_groups: int,
    prefix_len: int,
    suffix_len_range: tuple[int, int],
    allowed_ids: Sequence[int],
    rng: random.Random,
) -> list[list[int]]:
    """``n`` prompts: request ``i`` is the prefix of group ``group_of(i, num_groups)`` (``prefix_len``
    ids drawn from ``allowed_ids``) + a suffix of its own, of a length drawn from
    ``suffix_len_range``; the suffixes are pairwise distinct. Raises ValueError when there are not
    ``n`` distinct suffixes to draw."""
    # imported here: loadgen imports grpc, and the report imports this module
    from pagewire.bench.loadgen import prompt_lengths

    if num_groups < 1 or prefix_len < 1:
        raise ValueError(f"need num_groups >= 1 and prefix_len >= 1, got {num_groups} and {prefix_len}")
    if not allowed_ids:
        raise ValueError("no ordinary token id to build prompts from")
    prefixes = [rng.choices(allowed_ids, k=prefix_len) for _ in range(num_groups)]
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for i, length in enumerate(prompt_lengths(n, suffix_len_range, rng)):
        for _ in range(100):
            suffix = tuple(rng.choices(allowed_ids, k=length))
            if suffix not in seen:
                break
        else:
            raise ValueError(f"could not draw {n} distinct suffixes of {length} token(s) from "
                             f"{len(allowed_ids)} ids: use a longer --prompt-len")
        seen.add(suffix)
        prompts.append(prefixes[group_of(i, num_groups)] + list(suffix))
    return prompts


def ideal_hit_tokens(n: int, num_groups: int, prefix_len: int, block_size: int) -> int:
    """Prompt tokens of a run that a prefix cache of unbounded size could serve: the full blocks
    of the prefix, for every request but the first of its group."""
    return max(0, n - num_groups) * (prefix_len // block_size) * block_size


def ideal_hit_rate(run_prompt_lens: Sequence[Sequence[int]], num_groups: int, prefix_len: int,
                   block_size: int) -> float:
    """``ideal_hit_tokens`` of each run as a fraction of all their prompt tokens, pooled over the
    runs (``run_prompt_lens``: per run, the length of each prompt)."""
    total = sum(sum(lens) for lens in run_prompt_lens)
    hits = sum(ideal_hit_tokens(len(lens), num_groups, prefix_len, block_size) for lens in run_prompt_lens)
    return hits / total if total else 0.0


class PrefixCacheCounts(NamedTuple):
    """The server's prefix-cache counters, or their growth over a run."""

    queried_tokens: int  # prompt tokens looked up in the prefix cache
    hit_tokens: int  # of those, found there

    @property
    def hit_rate(self) -> float | None:
        """hit / queried; None when nothing was looked up (the prefix cache is off)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else None

    def since(self, before: PrefixCacheCounts) -> PrefixCacheCounts:
        return PrefixCacheCounts(self.queried_tokens - before.queried_tokens, self.hit_tokens - before.hit_tokens)

    def __add__(self, other: PrefixCacheCounts) -> PrefixCacheCounts:  # type: ignore[override]
        return PrefixCacheCounts(self.queried_tokens + other.queried_tokens, self.hit_tokens + other.hit_tokens)

    def to_dict(self) -> dict:
        return {"queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens, "hit_rate": self.hit_rate}


def prefix_cache_dict(runs: Sequence[PrefixCacheCounts]) -> dict:
    """One column's entry of the JSON's ``prefix_cache.engines``: known, per run and pooled."""
    total = PrefixCacheCounts(0, 0)
    for run in runs:
        total = total + run
    return {"known": True, "runs": [r.to_dict() for r in runs], "aggregate": total.to_dict()}


def prefix_cache_lines(prefix_cache: dict) -> list[str]:
    """The summary's lines: each column's hit rate over its measured runs, and the ideal."""
    ideal = prefix_cache["ideal_hit_rate"]
    ideal_text = "" if ideal is None else f"; ideal for this workload {ideal:.1%}"
    lines = []
    for name, entry in prefix_cache["engines"].items():
        if not entry["known"]:
            lines.append(f"prefix cache hit rate, {name}: not known ({entry['reason']})")
            continue
        agg = entry["aggregate"]
        counts = f"{agg['hit_tokens']:,} / {agg['queried_tokens']:,} prompt tokens"
        if agg["hit_rate"] is None:
            lines.append(f"prefix cache hit rate, {name}: n/a ({counts}: the server looked nothing up, its prefix "
                         f"cache is off){ideal_text}")
        else:
            lines.append(f"prefix cache hit rate, {name}: {agg['hit_rate']:.1%} ({counts}, the server's counters)"
                         f"{ideal_text}")
    return lines
