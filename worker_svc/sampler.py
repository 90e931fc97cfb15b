"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling inverts each row's cumulative distribution at one uniform draw: the token is the first
whose cumulative probability exceeds u * total. That draws from p exactly and needs one random
number per row (the exponential race, argmax of p / E with E ~ Exp(1) per vocabulary entry,
38 ms for 32 rows of a 49k vocabulary on our CPU, more than a model step; this: 2.5 ms; see
benchmarks/sampler_speed.py).
For a seeded request the number comes from a generator seeded with (seed, position), so a
seeded request gives the same tokens whatever else is in the batch and whether or not it was
preempted and recomputed.
With ``deterministic`` (``--deterministic``) an unrestricted row (no top-k, top-p or min-p) is
drawn on CPU by the C draw from its raw logits and its temperature whatever its batch-mates ask
for, rather than from logits prescaled by torch (``logits / T``) when some row needs them, which
rounds differently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagewire_common.sampling import SamplingParams
from worker_svc.cpu import sampler as cpu_sampler

log = logging.getLogger("pagewire.worker")

_SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 64 bits


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters of a step's sampled rows. The runner keeps one while the rows
    stay the same and sets only ``positions`` each step; what is read from ``params`` is read once."""

    params: list[SamplingParams]
    positions: Sequence[int]  # [N] position of the token being sampled (seeds the generator)
    want_logprobs: bool
    all_greedy: bool = field(init=False)
    seeded_rows: list[int] = field(init=False)  # rows that draw from their own (seed, position) generator

    def __post_init__(self) -> None:
        self.all_greedy = all(p.is_greedy for p in self.params)
        self.seeded_rows = [i for i, p in enumerate(self.params) if p.seed is not None and not p.is_greedy]


class Sampler:
    def __init__(self, device: torch.device, *, deterministic: bool = False):
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.seed()
        # on CPU, argmax and plain draws of float32 logits in C where it is vectorized (worker_svc.cpu.sampler)
        self._cpu = cpu_sampler.kernel() if self.device.type == "cpu" else None
        # unrestricted rows always by the C draw from raw logits (--deterministic)
        self._deterministic = deterministic
        if deterministic and self.device.type == "cpu" and self._cpu is None:
            log.warning("--deterministic: the sampler's C draw is not built here, so a sampled row's draw may "
                        "depend on its batch-mates")

    def _on_cpu_kernels(self, logits: torch.Tensor) -> bool:
        return self._cpu is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" \
            and logits.dim() == 2 and logits.shape[-1] > 0

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] -> each row's argmax [N] int64, the first of equal maxima."""
        if self._on_cpu_kernels(logits):
            return self._cpu.argmax(logits)
        return logits.argmax(dim=-1)

    def draw(self, logits: torch.Tensor, u: torch.Tensor, temps: torch.Tensor | None = None) -> torch.Tensor:
        """A draw per row from softmax(logits / temps) (``temps`` [N] > 0, None for logits already
        scaled) at u [N, 1]: the first token whose cumulative probability exceeds u times the total."""
        if self._on_cpu_kernels(logits):
            tokens = self._cpu.draw(logits, u, temps)
            left = (tokens < 0).nonzero().flatten()  # a NaN, or nothing finite: torch's way
            if left.numel():
                tokens[left] = self._torch_draw(logits[left], u[left], None if temps is None else temps[left])
            return tokens
        return self._torch_draw(logits, u, temps)

    @staticmethod
    def _torch_draw(logits: torch.Tensor, u: torch.Tensor, temps: torch.Tensor | None) -> torch.Tensor:
        scaled = logits if temps is None else logits / temps.unsqueeze(1)
        return _invert_cdf(torch.softmax(scaled, dim=-1).cumsum_(dim=-1), u)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """logits [N, V] fp32 -> (token ids [N] int64, logprobs [N] fp32 or None)."""
        logprobs = None
        if batch.want_logprobs:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if batch.all_greedy:
            tokens = self.greedy(logits)
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
        min_p_rows = [i for i, p in enumerate(params) if p.min_p > 0.0 and not p.is_greedy]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [p.top_p for p in params]
        restricted = [i for i in range(num_rows) if top_ks[i] < vocab or top_ps[i] < 1.0]
        # the C draw on CPU scales by the temperature itself: the scaled logits only where
        # min_p, top-k or top-p need them
        on_cpu_kernels = self._on_cpu_kernels(logits)
        unscaled = not min_p_rows and not restricted and on_cpu_kernels
        scaled = None
        if not unscaled:
            scaled = logits / temps.unsqueeze(1)
            if min_p_rows:
                _apply_min_p(scaled, min_p_rows, [params[i].min_p for i in min_p_rows])
        u = self._uniforms(batch, num_rows, logits.dtype)

        if len(restricted) == num_rows:
            tokens = _sample_top_k_top_p(scaled, top_ks, top_ps, u)
        elif unscaled:
            tokens = self.draw(logits, u, temps)
        elif self._deterministic and on_cpu_kernels:
            # every unrestricted row as it is drawn alone: raw logits, its own temperature; the
            # min_p rows (unless restricted: below) from their filtered scaled logits
            tokens = self.draw(logits, u, temps)
            restricted_set = set(restricted)
            min_p_only = [i for i in min_p_rows if i not in restricted_set]
            if min_p_only:
                rows = torch.tensor(min_p_only, device=self.device)
                tokens[rows] = self.draw(scaled[rows], u[rows])
        else:
            tokens = self.draw(scaled, u)
        if restricted and len(restricted) < num_rows:
            rows = torch.tensor(restricted, device=self.device)
            tokens[rows] = _sample_top_k_top_p(
                scaled[rows], [top_ks[i] for i in restricted], [top_ps[i] for i in restricted], u[rows]
            )
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=self.device)
            tokens[rows] = self.greedy(logits[rows])
        return tokens

    def _uniforms(self, batch: SamplingBatch, num_rows: int, dtype: torch.dtype) -> torch.Tensor:
        """[N, 1] uniforms in [0, 1): one batched draw, then a (seed, position) generator per seeded row."""
        u = torch.rand(num_rows, 1, generator=self._generator, device=self.device, dtype=dtype)
        for i in batch.seeded_rows:
            g = torch.Generator(device=self.device)
            g.manual_seed(_mix_seed(batch.params[i].seed, int(batch.positions[i])))
            u[i] = torch.rand(1, generator=g, device=self.device, dtype=dtype)
        return u


# A row with top_p but no top_k first looks for its nucleus among this many most likely tokens
# (exact when they hold it, which a sort of the whole vocabulary would confirm), and sorts the
# whole vocabulary only when they do not.
_TOP_P_CANDIDATES = 1024


def _invert_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index whose cumulative probability exceeds u * total: a draw from the row's
    distribution. cdf [N, K] nondecreasing (a cumsum of probabilities >= 0), u [N, 1] in [0, 1)."""
    total = cdf[:, -1:]
    # strictly below the total, so some entry exceeds it; an entry with zero probability (masked)
    # never does first
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _sample_top_k_top_p(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float], u: torch.Tensor) -> torch.Tensor:
    """Draw from each row's top-k, then its nucleus (the smallest prefix of the remaining tokens,
    most likely first, whose mass reaches top_p; its probabilities are those after top-k). Works
    on the candidates ``topk`` returns, and sorts the whole vocabulary only when it must."""
    vocab = scaled.shape[1]
    p_only = [k == vocab for k in top_ks]  # rows whose nucleus is over the whole vocabulary
    num_candidates = max(top_ks)
    if num_candidates == vocab:
        num_candidates = min(vocab, max([_TOP_P_CANDIDATES] + [k for k in top_ks if k < vocab]))
    values, indices = scaled.topk(num_candidates, dim=-1)  # sorted, most likely first
    probs = _probs_after_top_k(values, scaled, top_ks, p_only)
    cumulative = probs.cumsum(dim=-1)
    p = torch.tensor(top_ps, dtype=scaled.dtype, device=scaled.device).unsqueeze(1)
    if num_candidates < vocab and any(p_only):
        # the token after the last candidate is out of the nucleus iff the candidates' mass
        # reaches top_p; a row where it does not needs the whole vocabulary
        short = cumulative[:, -1] < p[:, 0]
        if bool(short[torch.tensor(p_only, device=scaled.device)].any()):
            values, indices = scaled.sort(dim=-1, descending=True)
            probs = _probs_after_top_k(values, scaled, top_ks, p_only)
            cumulative = probs.cumsum(dim=-1)
    probs = probs.masked_fill((cumulative - probs) >= p, 0.0)  # the mass before it reaches top_p
    return indices.gather(1, _invert_cdf(probs.cumsum(dim=-1), u).unsqueeze(1)).squeeze(1)


def _probs_after_top_k(values: torch.Tensor, scaled: torch.Tensor, top_ks: list[int], p_only: list[bool]) -> torch.Tensor:
    """Probabilities of the sorted candidate ``values`` with everything past each row's top-k
    zeroed: normalized over the top-k, or over the whole vocabulary for a row without top-k."""
    ranks = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    kept = values.masked_fill(ranks >= torch.tensor(top_ks, device=values.device).unsqueeze(1), float("-inf"))
    log_norm = torch.logsumexp(kept, dim=-1, keepdim=True)
    if any(p_only):
        rows = torch.tensor([i for i, only in enumerate(p_only) if only], device=values.device)
        log_norm[rows] = torch.logsumexp(scaled[rows], dim=-1, keepdim=True)
    return (kept - log_norm).exp()


def _apply_min_p(scaled: torch.Tensor, rows: list[int], min_ps: list[float]) -> None:
    """Drop (in place) the tokens whose probability is below min_p times the row's top one:
    p_i < min_p * p_max  <=>  x_i < x_max + log(min_p) for the temperature-scaled logits x."""
    rows_t = torch.tensor(rows, device=scaled.device)
    x = scaled[rows_t]
    log_min_p = torch.tensor(min_ps, dtype=x.dtype).log().to(scaled.device).unsqueeze(1)
    threshold = x.max(dim=-1, keepdim=True).values + log_min_p
    scaled[rows_t] = x.masked_fill(x < threshold, float("-inf"))


def _mix_seed(seed: int, position: int) -> int:
    x = (seed * _SEED_MIX + position * 0xBF58476D1CE4E5B9 + 1) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF
