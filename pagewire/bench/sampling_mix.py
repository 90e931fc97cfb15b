"""``--sampling-mix``: the same workload sent once per sampling mix, each mix a column of the table,
so that the difference between a mix's TPOT/ITL and plain greedy's is what its feature costs per
step (every step of a mixed run holds both kinds of request).

A mix other than ``greedy`` gives the feature to every other request (the odd ones) and leaves the
rest as the base sampling (``--temperature``, ``--ignore-eos``, ``--max-new-tokens``).
"""

from __future__ import annotations

import argparse
import json

# Open-ended (an array without maxItems), so that under --ignore-eos a constrained request runs
# to --max-new-tokens like the others; nested objects keep the matcher honest.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
        "required": ["name", "count", "tags"],
    }}},
    "required": ["items"],
}
BENCH_REGEX = r"([a-z]{1,12}( [a-z]{1,12}){0,9}\. )+"

MIXES = {
    "greedy": "every request as the base sampling (--temperature, greedy by default)",
    "penalties": "half the requests with repetition_penalty 1.1, presence_penalty 0.5, frequency_penalty 0.5",
    "logit_bias": "half the requests with a logit_bias of 8 tokens",
    "json_schema": "half the requests constrained to a JSON schema (an open-ended array of objects)",
    "regex": "half the requests constrained to a regex (sentences of lowercase words)",
}


def parse_mixes(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in MIXES]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give one or more of {', '.join(MIXES)}, comma-separated, got {text!r}")
    return names


def help_text() -> str:
    return ("send each run once per mix, comma-separated, each mix a column of the table (the first is "
            "'pagewire', the others 'pagewire-MIX', compared with the first); a mix other than greedy changes "
            "every other request: " + "; ".join(f"{name}: {what}" for name, what in MIXES.items())
            + ". With greedy first, a column's TPOT/ITL over greedy's is what its feature costs per step "
            "(default: greedy)")


def apply_mix(requests: list, mix: str) -> list:
    """Copies of ``requests`` (``pb.GenerateRequest``) with ``mix``'s sampling on every other one."""
    out = []
    for i, req in enumerate(requests):
        req = type(req).FromString(req.SerializeToString())
        if i % 2 == 1:
            s = req.sampling
            if mix == "penalties":
                s.repetition_penalty, s.presence_penalty, s.frequency_penalty = 1.1, 0.5, 0.5
            elif mix == "logit_bias":
                for token in range(100, 108):
                    s.logit_bias[token] = -2.0 if token % 2 else 2.0
            elif mix == "json_schema":
                s.json_schema = json.dumps(BENCH_SCHEMA)
            elif mix == "regex":
                s.regex = BENCH_REGEX
        out.append(req)
    return out
