"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which draws from p exactly
and needs one random number per vocabulary entry. For a seeded request those numbers come from
a generator seeded with (seed, position), so a seeded request gives the same tokens whatever
else is in the batch and whether or not it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewire.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 64 bits


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters for one step, built on the host once per step."""

    params: list[SamplingParams]
    positions: list[int]  # position of the token being sampled (seeds the generator)
    want_logprobs: bool

    @property
    def all_greedy(self) -> bool:
        return all(p.is_greedy for p in self.params)


class Sampler:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.seed()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [N, V] fp32 -> (token ids [N] int64, logprobs [N] fp32 or None)."""
        logprobs = None
        if batch.want_logprobs:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, batch)
        if batch.want_logprobs:
            logprobs = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, logprobs

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        num_rows, vocab = logits.shape
        params = batch.params
        greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
        temps = torch.tensor(
            [1.0 if p.is_greedy else p.temperature for p in params], dtype=logits.dtype
        ).to(self.device, non_blocking=True)
        scaled = logits / temps.unsqueeze(1)

        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
            scaled = _apply_top_k_top_p(scaled, top_ks, top_ps, self.device)
        probs = torch.softmax(scaled, dim=-1)

        # Exp(1) noise: one batched draw for unseeded rows, a (seed, position) generator per seeded row.
        noise = torch.empty_like(probs).exponential_(generator=self._generator)
        for i, p in enumerate(params):
            if p.seed is not None and not p.is_greedy:
                g = torch.Generator(device=self.device)
                g.manual_seed(_mix_seed(p.seed, batch.positions[i]))
                noise[i].exponential_(generator=g)
        tokens = (probs / noise).argmax(dim=-1)
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=self.device)
            tokens[rows] = logits[rows].argmax(dim=-1)
        return tokens


def _apply_top_k_top_p(
    logits: torch.Tensor, top_ks: list[int], top_ps: list[float], device: torch.device
) -> torch.Tensor:
    """Mask everything outside each row's top-k and nucleus (top-p) to -inf."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor(top_ks, device=device).unsqueeze(1)
    mask = ranks >= k  # outside top-k
    p = torch.tensor(top_ps, dtype=logits.dtype, device=device).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(mask, float("-inf")), dim=-1)
    # drop a token when the mass of the tokens before it already reaches top_p (the first always stays)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    mask |= mass_before >= p
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _mix_seed(seed: int, position: int) -> int:
    x = (seed * _SEED_MIX + position * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF
