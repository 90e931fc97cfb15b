"""Tensor parallelism: the ranks' process group (``group``), the plan hand-off from rank 0 to the
other ranks (``handoff``), and starting, joining and running the ranks (``ranks``)."""

from worker_svc.parallel.group import SINGLE, GroupFailed, TensorParallel

__all__ = ["SINGLE", "GroupFailed", "TensorParallel"]
