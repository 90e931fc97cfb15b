"""The sampler draws from the right distribution, honours top-k/top-p, and seeds by (seed, position)."""

from __future__ import annotations

import torch

from pagewire_common.sampling import SamplingParams
from worker_svc.sampler import Sampler, SamplingBatch

VOCAB = 6


def _draw(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, rows: int, position: int = 0) -> torch.Tensor:
    batch = SamplingBatch([params] * rows, [position] * rows, want_logprobs=False)
    tokens, _ = sampler(logits.expand(rows, -1).contiguous(), batch)
    return tokens


def _frequencies(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=VOCAB).double() / tokens.numel()


def test_draws_follow_the_softmax():
    torch.manual_seed(0)
    sampler = Sampler("cpu")
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -30.0]])
    n = 200_000
    tokens = torch.cat([_draw(sampler, logits, SamplingParams(temperature=1.0), 10_000) for _ in range(n // 10_000)])
    expected = torch.softmax(logits[0].double(), -1)
    freq = _frequencies(tokens)
    # 4 standard errors of a binomial proportion per token
    tolerance = 4 * (expected * (1 - expected) / n).sqrt() + 1e-12
    assert ((freq - expected).abs() <= tolerance).all(), (freq, expected)
    assert freq[5] == 0  # probability ~1e-14


def test_temperature_sharpens_and_flattens():
    sampler = Sampler("cpu")
    logits = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 50_000
    cold = _frequencies(_draw(sampler, logits, SamplingParams(temperature=0.25), n))
    hot = _frequencies(_draw(sampler, logits, SamplingParams(temperature=4.0), n))
    p_cold = torch.softmax(logits[0].double() / 0.25, -1)[0]
    p_hot = torch.softmax(logits[0].double() / 4.0, -1)[0]
    assert abs(cold[0] - p_cold) < 0.01 and abs(hot[0] - p_hot) < 0.01


def test_top_k_and_top_p_never_draw_outside_the_kept_set():
    sampler = Sampler("cpu")
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -0.5, -1.0]])
    n = 20_000
    top2 = _frequencies(_draw(sampler, logits, SamplingParams(temperature=1.0, top_k=2), n))
    assert top2[2:].sum() == 0 and top2[0] > 0 and top2[1] > 0
    probs = torch.softmax(logits[0], -1)
    # top_p just above the first two tokens' mass keeps exactly three tokens
    p = float(probs[:2].sum()) + 1e-3
    nucleus = _frequencies(_draw(sampler, logits, SamplingParams(temperature=1.0, top_p=p), n))
    assert nucleus[3:].sum() == 0 and (nucleus[:3] > 0).all()
    kept = probs[:3].double() / probs[:3].sum()
    assert torch.allclose(nucleus[:3], kept, atol=0.015)


def test_seeded_rows_depend_on_seed_and_position_only():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    sp = SamplingParams(temperature=1.0, seed=42)
    a = _draw(Sampler("cpu"), logits, sp, rows=1, position=7)
    # same seed and position in a bigger batch, with unseeded rows around it, on another sampler
    mixed = [SamplingParams(temperature=1.0)] * 3 + [sp]
    batch = SamplingBatch(mixed, [7] * 4, want_logprobs=False)
    tokens, _ = Sampler("cpu")(logits.expand(4, -1).contiguous(), batch)
    assert tokens[3] == a[0]
    # different positions give different draws (over many positions, not all equal)
    draws = {int(_draw(Sampler("cpu"), logits, sp, rows=1, position=pos)[0]) for pos in range(20)}
    assert len(draws) > 5


def test_greedy_rows_in_a_sampled_batch_take_the_argmax():
    sampler = Sampler("cpu")
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0), SamplingParams(temperature=0), SamplingParams(temperature=2.0)]
    tokens, _ = sampler(logits, SamplingBatch(params, [0] * 4, want_logprobs=False))
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_p_candidates_give_the_same_draws_as_the_whole_vocabulary(monkeypatch):
    """Top-p looks for the nucleus among the most likely tokens first; whether they hold it or
    it falls back to sorting everything, every draw must equal the whole-vocabulary answer."""
    from worker_svc import sampler as sampler_mod

    gen = torch.Generator().manual_seed(11)
    scaled = torch.randn(5, 40, generator=gen) * 2
    scaled[0, :3] += 8  # a peaked row: three tokens hold the nucleus
    top_ks = [40, 40, 5, 40, 40]
    top_ps = [0.9, 0.99, 0.8, 0.5, 1.0]
    grid = torch.linspace(0, 0.999, 200)
    results = {}
    for candidates in (3, 10, 1024):
        monkeypatch.setattr(sampler_mod, "_TOP_P_CANDIDATES", candidates)
        draws = []
        for u in grid:
            draws.append(sampler_mod._sample_top_k_top_p(scaled, top_ks, top_ps, torch.full((5, 1), float(u))))
        results[candidates] = torch.stack(draws)
    assert torch.equal(results[3], results[1024]) and torch.equal(results[10], results[1024])
    # and the kept sets are what the definitions say
    probs = torch.softmax(scaled[0], -1)
    order = probs.argsort(descending=True)
    mass_before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[mass_before < 0.9].tolist())
    assert set(results[1024][:, 0].tolist()) == nucleus
    assert set(results[1024][:, 2].tolist()) <= set(scaled[2].topk(5).indices.tolist())
