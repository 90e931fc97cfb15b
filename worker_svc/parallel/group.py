"""One rank's place in the tensor-parallel group and the collectives the sharded layers use.

With one rank (``SINGLE``) every collective returns its input untouched and no process group
exists: the N = 1 path runs no torch.distributed code at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class GroupFailed(RuntimeError):
    """A collective failed: a rank died or stopped answering. The group cannot go on (the ranks'
    states may now differ); the worker must stop, and is restarted whole."""


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's rank among ``size`` ranks; ``group`` runs the math collectives (gloo on
    CPU, NCCL on CUDA), None when ``size == 1``."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def split(self, total: int, what: str = "size") -> int:
        """This rank's even share of ``total`` (ValueError when it does not divide)."""
        if total % self.size:
            raise ValueError(f"{what} {total} does not split over {self.size} tensor-parallel ranks")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` [N, d] side by side on rank 0 ([N, size * d]); None on the others."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (e.g. the KV blocks every rank can hold)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(self.group) == "gloo" else torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())


SINGLE = TensorParallel()
