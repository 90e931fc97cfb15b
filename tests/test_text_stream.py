"""``OutputProcessor.apply``'s short path for plain streams (byte-level text, no stop strings, no
logprobs, stream_interval 1) gives the deltas its general path gives, token for token."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagewire_common.core_messages import CoreOutputs
from pagewire_common.requests import FinishReason
from pagewire_common.sampling import SamplingParams
from scheduler_svc.api.text_stream import OutputProcessor
from scheduler_svc.api.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer(tiny_model_dir("llama-gqa"))


def run(tok: Tokenizer, plain: bool, seed: int) -> list:
    rng = random.Random(seed)
    op = OutputProcessor(tok)
    # tokens of multi-byte characters, split across tokens, among ordinary ones
    pieces = tok.encode("héllo wörld — 日本語 🙂! plain words and more") + list(range(3, 300))
    kinds = [SamplingParams(temperature=0, max_tokens=40),
             SamplingParams(temperature=0, max_tokens=40, logprobs=True),
             SamplingParams(temperature=0, max_tokens=40, stop=["or"])]
    num = 24
    for rid in range(num):
        for stream in op.add(rid, f"r{rid}", [rng.choice(pieces) for _ in range(5)], kinds[rid % 3] if rid % 4 else kinds[0]):
            assert stream.plain == (rid % 4 == 0 or rid % 3 == 0), rid  # the first kind only
            stream.plain = stream.plain and plain
    deltas = []
    live = list(range(num))
    step = 0
    while live:
        step += 1
        ids = [r for r in live if rng.random() < 0.9]
        finishing = [r for r in ids if rng.random() < 0.08 or step > 30]
        out = CoreOutputs(request_ids=np.array(ids, dtype=np.int64),
                          token_ids=np.array([rng.choice(pieces) for _ in ids], dtype=np.int32),
                          logprobs=np.array([-rng.random() for _ in ids], dtype=np.float32),
                          finished_ids=finishing, finish_reasons=[FinishReason.LENGTH] * len(finishing))
        if step == 1:
            out.started_ids, out.num_cached_prompt_tokens = ids, [0] * len(ids)
        ready, stopped = op.apply(out)
        for rid in set(finishing) | set(stopped):
            if rid in live:
                live.remove(rid)
        op_streams = op.streams
        for rid in stopped:
            op_streams.pop(rid, None)
        deltas.extend(sorted(((rid, d.token_ids, d.text, d.finish_reason, d.logprobs, d.usage) for rid, d in ready),
                             key=lambda x: x[0]))
    return deltas


@pytest.mark.parametrize("seed", range(4))
def test_plain_streams_take_the_short_path_to_the_same_deltas(tok, seed):
    short, general = run(tok, True, seed), run(tok, False, seed)
    assert short == general
    assert sum(1 for d in short if d[3] is None) > 100 and any(ord(c) > 127 for d in short for c in d[2])
