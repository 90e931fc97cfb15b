"""The sharded layers, the slice readers and the plan hand-off, in one process: each rank's
shard is built with its rank number and no process group, and the ranks' partial results are
combined by hand as the collectives would."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from worker_svc.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, kv_heads_per_rank, qkv_parts
from worker_svc.layers.linear import split_parts
from worker_svc.layers.sources import SafetensorsSource, TensorSource, TransposedSource
from worker_svc.parallel.group import TensorParallel
from worker_svc.parallel.handoff import FIRST_CHUNK, Kind, PlanChannel


@dataclass(frozen=True, slots=True)
class LocalOnly(TensorParallel):
    """A rank whose collectives return its own part (the test sums the parts)."""

    def all_reduce(self, x):
        return x

    def gather_last_dim(self, x):
        return x


def rows_of(layer: ColumnParallelLinear, weights: list[torch.Tensor]) -> torch.Tensor:
    for shard, w in enumerate(weights):
        layer.load_shard("weight", shard, TensorSource(w))
    return layer.weight.data


@pytest.mark.parametrize("num_heads, num_kv_heads, size, expected_kv_head", [
    (4, 2, 2, [0, 1]),  # split: one KV head each
    (4, 1, 2, [0, 0]),  # fewer KV heads than ranks: a replica each
    (8, 2, 4, [0, 0, 1, 1]),  # ranks 0-1 hold query heads of KV head 0, ranks 2-3 of KV head 1
])
def test_qkv_shards_hold_their_query_heads_and_the_kv_heads_they_use(num_heads, num_kv_heads, size, expected_kv_head):
    head_dim, hidden = 3, 5
    q = torch.randn(num_heads * head_dim, hidden)
    k = torch.randn(num_kv_heads * head_dim, hidden)
    v = torch.randn(num_kv_heads * head_dim, hidden)
    for rank in range(size):
        tp = TensorParallel(rank, size)
        layer = ColumnParallelLinear(hidden, qkv_parts(num_heads, num_kv_heads, head_dim, tp), bias=False)
        local = rows_of(layer, [q, k, v])
        heads = num_heads // size
        kv = expected_kv_head[rank]
        assert kv_heads_per_rank(num_kv_heads, tp) == 1
        torch.testing.assert_close(local, torch.cat([
            q[rank * heads * head_dim : (rank + 1) * heads * head_dim],
            k[kv * head_dim : (kv + 1) * head_dim],
            v[kv * head_dim : (kv + 1) * head_dim],
        ]), rtol=0, atol=0)


def test_column_then_row_parallel_sums_to_the_full_mlp():
    hidden, inter, size = 6, 8, 2
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    bias = torch.randn(hidden)
    x = torch.randn(3, hidden)
    full = F.linear(F.silu(x @ gate.t()) * (x @ up.t()), down, bias)
    total = torch.zeros_like(full)
    for rank in range(size):
        tp = LocalOnly(rank, size)
        gate_up = ColumnParallelLinear(hidden, split_parts([inter, inter], tp), bias=False)
        rows_of(gate_up, [gate, up])
        down_proj = RowParallelLinear(inter, hidden, bias=True, tp=tp)
        down_proj.load_shard("weight", 0, TensorSource(down))
        down_proj.load_shard("bias", 0, TensorSource(bias))
        g, u = gate_up(x).chunk(2, dim=-1)
        total += F.linear(F.silu(g) * u, down_proj.weight)  # this rank's partial product
    torch.testing.assert_close(total + bias, full)


def test_vocab_parallel_embedding_with_a_vocabulary_that_does_not_divide():
    vocab, hidden, size = 7, 4, 2
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 6, 2])
    summed = torch.zeros(len(ids), hidden)
    logits = []
    for rank in range(size):
        emb = VocabParallelEmbedding(vocab, hidden, LocalOnly(rank, size))
        emb.load_shard("weight", 0, TensorSource(table))
        assert emb.weight.shape == (4, hidden)  # ceil(7 / 2) rows, the last rank padded with zeros
        summed += emb(ids)
        logits.append(F.linear(torch.ones(2, hidden), emb.weight))
    torch.testing.assert_close(summed, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], F.linear(torch.ones(2, hidden), table))
    assert torch.equal(torch.cat(logits, dim=-1)[:, vocab:], torch.zeros(2, 1))


def test_safetensors_slices_read_only_what_is_asked(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    w = torch.arange(24, dtype=torch.float32).view(4, 6)
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as handle:
        src = SafetensorsSource(handle.get_slice("w"))
        assert src.shape == (4, 6)
        assert torch.equal(src.narrow(0, 1, 2), w[1:3])
        assert torch.equal(src.narrow(1, 2, 3), w[:, 2:5])
        assert torch.equal(src.read(), w)
        t = TransposedSource(src)  # GPT-2's Conv1D layout
        assert t.shape == (6, 4)
        assert torch.equal(t.narrow(0, 2, 3), w.t()[2:5])
        assert torch.equal(t.narrow(1, 1, 2), w.t()[:, 1:3])


class LoopbackChannel(PlanChannel):
    """Rank 0's broadcasts recorded, replayed to a receiving rank in order."""

    def __init__(self, sent: list[torch.Tensor], receiving: bool):
        super().__init__(group=None)
        self.sent = sent
        self.receiving = receiving
        self.num_broadcasts = 0

    def _broadcast(self, buffer):
        self.num_broadcasts += 1
        if self.receiving:
            buffer.copy_(self.sent.pop(0))
        else:
            self.sent.append(buffer.clone())


@pytest.mark.parametrize("payload_size, broadcasts", [(100, 1), (FIRST_CHUNK * 3, 2)])
def test_plan_handoff_carries_kind_sampled_ids_and_payload(payload_size, broadcasts):
    sent: list[torch.Tensor] = []
    sender, receiver = LoopbackChannel(sent, False), LoopbackChannel(sent, True)
    payload = bytes(range(256)) * (payload_size // 256) + b"x" * (payload_size % 256)
    sender.send(Kind.PLAN, [7, 2**40, 0], payload)
    sender.send(Kind.RESET)
    assert sender.num_broadcasts == broadcasts + 1
    assert receiver.receive() == (Kind.PLAN, [7, 2**40, 0], payload)
    assert receiver.receive() == (Kind.RESET, [], b"")
    assert sent == [] and receiver.num_broadcasts == sender.num_broadcasts
