"""Sampling parameters shared by the offline API, the scheduler and the worker.

Pure Python: the scheduler imports this and must never pull in torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_SEED = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    ``temperature == 0`` means greedy decoding; ``top_k == 0`` and ``top_p == 1.0`` switch
    those filters off. ``seed`` makes a sampled request reproducible: the same prompt,
    parameters and seed give the same tokens whatever else is in the batch. ``stop`` strings
    end generation and are cut from the returned text; ``stop_token_ids`` end it and are kept
    in ``token_ids``. ``logprobs`` asks for the log-probability of each sampled token under the
    model's distribution (before temperature and filters).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and frozen into tuples so the params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that is out of range."""
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if math.isinf(self.temperature):
            raise ValueError("temperature must be finite")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not (0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if t < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {t}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
