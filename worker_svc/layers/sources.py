"""Where a checkpoint tensor comes from, read whole or one slice at a time.

A tensor-parallel rank reads only its slices of each weight: from a safetensors file the slice
is read from the file without the rest (``safe_open(...).get_slice``); from a ``.bin`` checkpoint
(already in memory) it is a view. Layers that shard a weight ask their source for their rows
(``narrow``); the others ``read`` it whole.
"""

from __future__ import annotations

from typing import Protocol

import torch


class WeightSource(Protocol):
    shape: tuple[int, ...]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor: ...

    def read(self) -> torch.Tensor: ...


class TensorSource:
    """A tensor already in memory."""

    __slots__ = ("tensor", "shape")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.tensor.narrow(dim, start, length)

    def read(self) -> torch.Tensor:
        return self.tensor


class SafetensorsSource:
    """One tensor of an open safetensors file; a slice reads only its own bytes."""

    __slots__ = ("handle", "shape")

    def __init__(self, handle):  # a safetensors PySafeSlice (safe_open(...).get_slice(name))
        self.handle = handle
        self.shape = tuple(handle.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.handle[index]

    def read(self) -> torch.Tensor:
        return self.handle[:]


class TransposedSource:
    """A 2-D source seen transposed (GPT-2's Conv1D weights are stored [in, out])."""

    __slots__ = ("source", "shape")

    def __init__(self, source: WeightSource):
        self.source = source
        self.shape = tuple(reversed(source.shape))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.source.narrow(1 - dim, start, length).t()

    def read(self) -> torch.Tensor:
        return self.source.read().t()


def as_source(value) -> WeightSource:
    return TensorSource(value) if isinstance(value, torch.Tensor) else value
