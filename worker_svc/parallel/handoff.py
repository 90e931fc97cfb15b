"""Rank 0 hands every step plan to the other ranks: one broadcast on the group's control channel.

A message is ``[kind, num_token_ids, payload_bytes]`` (int64), then the token ids, then the
payload (a serialized ``pagewire.v1.StepPlan``). It goes out in a fixed first chunk of
``FIRST_CHUNK`` bytes, which holds every decode plan of a few hundred sequences, and only a
longer message (big prompts) needs a second broadcast for the rest. The token ids are what rank
0 sampled in the previous step: the other ranks append them to their sequences before applying
the plan, so all ranks keep the same per-sequence state (and overlapped plans, whose decode
inputs are the previous step's samples, work on every rank) with no collective of its own.

The channel is a gloo group of its own (on CUDA too: the plan lives on the host) with a long
timeout, since the other ranks wait on it for as long as the worker is idle.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch

FIRST_CHUNK = 4096
_HEADER = np.dtype("<i8")
_HEADER_BYTES = 3 * _HEADER.itemsize


class Kind(IntEnum):
    PLAN = 1  # compute this plan
    RESET = 2  # drop every sequence (a scheduler connected or left)
    STOP = 3  # the worker is stopping: exit


class PlanChannel:
    """One end of the hand-off: rank 0 ``send``s, every other rank ``receive``s, in the same order."""

    def __init__(self, group, source_rank: int = 0):
        self.group = group
        self.source_rank = source_rank
        self.num_bytes_sent = 0

    def _broadcast(self, buffer: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(buffer, src=self.source_rank, group=self.group)

    def send(self, kind: Kind, token_ids: list[int] = (), payload: bytes = b"") -> None:
        body = b"".join((
            np.array([kind, len(token_ids), len(payload)], dtype=_HEADER).tobytes(),
            np.asarray(token_ids, dtype=_HEADER).tobytes(),
            payload,
        ))
        first = np.zeros(FIRST_CHUNK, dtype=np.uint8)
        head = np.frombuffer(body, dtype=np.uint8, count=min(len(body), FIRST_CHUNK))
        first[: len(head)] = head
        self._broadcast(torch.from_numpy(first))
        if len(body) > FIRST_CHUNK:
            self._broadcast(torch.from_numpy(np.frombuffer(body, dtype=np.uint8, offset=FIRST_CHUNK).copy()))
        self.num_bytes_sent += len(body)

    def receive(self) -> tuple[Kind, list[int], bytes]:
        first = torch.empty(FIRST_CHUNK, dtype=torch.uint8)
        self._broadcast(first)
        data = first.numpy()
        kind, num_tokens, num_payload = np.frombuffer(data, dtype=_HEADER, count=3).tolist()
        total = _HEADER_BYTES + 8 * num_tokens + num_payload
        if total > FIRST_CHUNK:
            rest = torch.empty(total - FIRST_CHUNK, dtype=torch.uint8)
            self._broadcast(rest)
            data = np.concatenate((data, rest.numpy()))
        token_ids = np.frombuffer(data, dtype=_HEADER, count=num_tokens, offset=_HEADER_BYTES).tolist()
        payload = data[_HEADER_BYTES + 8 * num_tokens : total].tobytes()
        return Kind(kind), token_ids, payload
