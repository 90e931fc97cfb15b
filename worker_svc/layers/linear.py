"""Linear layers with fused outputs, and loading Hugging Face weights into them by name."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One matmul for several projections of the same input (q/k/v, gate/up); checkpoints keep them
    apart, so each part loads into its row range with :meth:`load_shard`."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        start = sum(self.output_sizes[:shard])
        target = param.data.narrow(0, start, self.output_sizes[shard])
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {param_name} shard {shard}: {tuple(tensor.shape)} vs {tuple(target.shape)}")
        target.copy_(tensor)


def load_weights_by_name(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: dict[str, tuple[str, int]] | None = None,
) -> None:
    """Copy checkpoint tensors into ``model``'s parameters by name.

    ``stacked`` maps a checkpoint module name to (fused module name, shard): ``{"q_proj": ("qkv_proj", 0)}``
    loads ``...self_attn.q_proj.weight`` into rows of ``...self_attn.qkv_proj.weight``. Names must already
    be normalized by the caller. Raises ValueError naming every unexpected, missing or misshapen weight.
    """
    stacked = stacked or {}
    params = dict(model.named_parameters())
    expected: set[str] = set()
    for name in params:
        module_name, _, param_name = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, MergedLinear):
            expected.update(f"{name}#{shard}" for shard in range(len(module.output_sizes)))
        else:
            expected.add(name)
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in weights:
            module_name, _, param_name = name.rpartition(".")
            parent, _, leaf = module_name.rpartition(".")
            if leaf in stacked:
                fused, shard = stacked[leaf]
                fused_module_name = f"{parent}.{fused}" if parent else fused
                key = f"{fused_module_name}.{param_name}#{shard}"
                if key not in expected:
                    unexpected.append(name)
                    continue
                model.get_submodule(fused_module_name).load_shard(param_name, shard, tensor)
                loaded.add(key)
                continue
            param = params.get(name)
            if param is None:
                unexpected.append(name)
                continue
            if param.shape != tensor.shape:
                raise ValueError(f"shape mismatch for weight {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
            param.data.copy_(tensor)
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
