"""Linear layers sharded Megatron-style over the tensor-parallel ranks, and loading Hugging Face
weights into them by name, each rank reading only its slices.

- ``ColumnParallelLinear`` splits the output features: each rank computes its own rows of every
  part (q/k/v heads, gate/up), no collective. A layer fuses several checkpoint tensors (q/k/v,
  gate/up) or several parts of one (GPT-2's c_attn) into one matmul.
- ``RowParallelLinear`` splits the input features: each rank multiplies its columns by the
  activations it holds (the column-parallel layer's output), and one all-reduce sums the partial
  products; the bias is added once, after the sum.

With one rank both are a plain ``nn.Linear`` (same parameters, same matmul, no collective).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.layers.sources import WeightSource, as_source
from worker_svc.parallel.group import SINGLE, TensorParallel


class Part(NamedTuple):
    """Rows ``[source_start, source_start + size)`` of checkpoint tensor ``shard`` (whose first
    dimension is ``source_rows``) are this rank's next ``size`` output features."""

    shard: int
    size: int
    source_start: int
    source_rows: int


def split_parts(sizes: list[int], tp: TensorParallel) -> list[Part]:
    """Each of ``sizes`` (one checkpoint tensor each) split evenly over the ranks."""
    parts = []
    for shard, total in enumerate(sizes):
        size = tp.split(total, "output size")
        parts.append(Part(shard, size, tp.rank * size, total))
    return parts


def kv_heads_per_rank(num_kv_heads: int, tp: TensorParallel) -> int:
    """KV heads split over the ranks, or one per rank (replicated) when there are more ranks than
    heads; each rank's paged cache holds its own."""
    if num_kv_heads >= tp.size:
        return tp.split(num_kv_heads, "the number of KV heads")
    if tp.size % num_kv_heads:
        raise ValueError(f"{tp.size} tensor-parallel ranks cannot share {num_kv_heads} KV heads evenly")
    return 1


def qkv_parts(num_heads: int, num_kv_heads: int, head_dim: int, tp: TensorParallel) -> list[Part]:
    """This rank's query heads and the KV heads they attend with, from q_proj, k_proj, v_proj."""
    heads = tp.split(num_heads, "the number of attention heads")
    kv_heads = kv_heads_per_rank(num_kv_heads, tp)
    # the first KV head of this rank's query heads (a group of num_heads // num_kv_heads shares one)
    first_kv = tp.rank * heads // (num_heads // num_kv_heads)
    q = Part(0, heads * head_dim, tp.rank * heads * head_dim, num_heads * head_dim)
    kv_rows = num_kv_heads * head_dim
    k = Part(1, kv_heads * head_dim, first_kv * head_dim, kv_rows)
    return [q, k, k._replace(shard=2)]


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of one or more projections of the same input: [T, in] -> [T, sum of
    part sizes], with no collective. ``parts`` say which checkpoint rows each local row holds."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool):
        super().__init__(in_features, sum(p.size for p in parts), bias=bias)
        self.parts = list(parts)
        self.num_shards = 1 + max(p.shard for p in parts)

    def load_shard(self, param_name: str, shard: int, source: WeightSource) -> None:
        param = getattr(self, param_name).data
        offset = 0
        for part in self.parts:
            if part.shard == shard:
                expected = (part.source_rows, *param.shape[1:])
                if tuple(source.shape) != expected:
                    raise ValueError(f"shape mismatch for {param_name} shard {shard}: checkpoint "
                                     f"{tuple(source.shape)}, expected {expected}")
                param.narrow(0, offset, part.size).copy_(source.narrow(0, part.source_start, part.size))
            offset += part.size


class RowParallelLinear(nn.Linear):
    """[T, in / N] (this rank's input features) -> [T, out], summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__(tp.split(in_features, "input size"), out_features, bias=bias)
        self.tp = tp
        self.num_shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)

    def load_shard(self, param_name: str, shard: int, source: WeightSource) -> None:
        param = getattr(self, param_name).data
        if param_name == "bias":
            _copy_whole(param, source, f"{param_name}")
            return
        expected = (self.out_features, self.in_features * self.tp.size)
        if tuple(source.shape) != expected:
            raise ValueError(f"shape mismatch for {param_name}: checkpoint {tuple(source.shape)}, expected {expected}")
        param.copy_(source.narrow(1, self.tp.rank * self.in_features, self.in_features))

    def packed(self, make_linear) -> nn.Module:
        """This layer with its weight repacked by ``make_linear(weight, bias)`` (a packed layer of
        ``worker_svc.cpu.linear``); the all-reduce and the bias stay around it."""
        from worker_svc.cpu.linear import PackedRowParallel

        if self.tp.size == 1:
            return make_linear(self.weight, self.bias)
        return PackedRowParallel(make_linear(self.weight, None), self.bias, self.tp)


def _copy_whole(param: torch.Tensor, source: WeightSource, name: str) -> None:
    if tuple(param.shape) != tuple(source.shape):
        raise ValueError(f"shape mismatch for weight {name}: checkpoint {tuple(source.shape)}, model {tuple(param.shape)}")
    param.copy_(source.read())


def load_weights_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | WeightSource]],
    stacked: dict[str, tuple[str, int]] | None = None,
) -> None:
    """Copy checkpoint tensors (or sources that read slices) into ``model``'s parameters by name.

    ``stacked`` maps a checkpoint module name to (fused module name, shard): ``{"q_proj": ("qkv_proj", 0)}``
    loads ``...self_attn.q_proj.weight`` into rows of ``...self_attn.qkv_proj.weight``. A module with
    ``load_shard`` (the sharded layers) takes its own slice; other parameters are read whole. Names
    must already be normalized by the caller. Raises ValueError naming every unexpected, missing or
    misshapen weight.
    """
    stacked = stacked or {}
    params = dict(model.named_parameters())
    expected: set[str] = set()
    for name in params:
        module_name, _, param_name = name.rpartition(".")
        num_shards = getattr(model.get_submodule(module_name), "num_shards", 1)
        if num_shards > 1:
            expected.update(f"{name}#{shard}" for shard in range(num_shards))
        else:
            expected.add(name)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, value in weights:
            source = as_source(value)
            module_name, _, param_name = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            if leaf in stacked:
                fused, shard = stacked[leaf]
                fused_module_name = f"{parent}.{fused}" if parent else fused
                key = f"{fused_module_name}.{param_name}#{shard}"
                if key not in expected:
                    unexpected.append(name)
                    continue
                model.get_submodule(fused_module_name).load_shard(param_name, shard, source)
                loaded.add(key)
                continue
            param = params.get(name)
            if param is None or name not in expected:
                unexpected.append(name)
                continue
            module = model.get_submodule(module_name)
            if hasattr(module, "load_shard"):
                module.load_shard(param_name, 0, source)
            else:
                _copy_whole(param.data, source, name)
            loaded.add(name)
    checkpoint_leaf = {target: leaf for leaf, target in stacked.items()}
    missing = sorted(_checkpoint_name(key, checkpoint_leaf) for key in expected - loaded)
    if unexpected or missing:
        parts = []
        if unexpected:
            parts.append(f"unexpected weights: {', '.join(sorted(unexpected)[:20])}" + (" ..." if len(unexpected) > 20 else ""))
        if missing:
            parts.append(f"missing weights: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
        raise ValueError(f"{type(model).__name__}: " + "; ".join(parts))


def _checkpoint_name(key: str, checkpoint_leaf: dict[tuple[str, int], str]) -> str:
    """'a.qkv_proj.weight#1' -> 'a.k_proj.weight' (the name the checkpoint should have had)."""
    name, sep, shard = key.partition("#")
    if not sep:
        return name
    module_name, _, param_name = name.rpartition(".")
    parent, _, fused = module_name.rpartition(".")
    leaf = checkpoint_leaf.get((fused, int(shard)), f"{fused}[{shard}]")
    return f"{parent}.{leaf}.{param_name}" if parent else f"{leaf}.{param_name}"
