"""kvcache.paged: batched append, block copies, paged attention against a dense reference."""

from __future__ import annotations

import math

import pytest
import torch

from kvcache import paged
from kvcache.paged import AttentionMetadata, PagedKVCache, paged_attention, paged_attention_ref, write_kv


@pytest.fixture(scope="module", autouse=True)
def _worker_cpu_attention():
    """CPU attention dispatched as in a worker, which registers its C kernel at start-up."""
    from worker_svc.cpu.attention import kernel

    paged.use_cpu_attention(kernel)
    yield
    paged.use_cpu_attention(None)


def make_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_ids: list[list[int]],
    block_size: int,
) -> AttentionMetadata:
    """Metadata for sequences whose last ``query_lens[i]`` of ``seq_lens[i]`` tokens are scheduled."""
    slots = []
    for q_len, seq_len, blocks in zip(query_lens, seq_lens, block_ids):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    max_blocks = max(len(b) for b in block_ids)
    table = torch.zeros((len(block_ids), max_blocks), dtype=torch.int32)
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=table,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.int64),
    )


def dense_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Naive causal attention of the last q positions over a contiguous context.
    query [q, H, D], key/value [L, Hkv, D] -> [q, H, D]."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), key.double()) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value.double()).float()


def test_write_kv_puts_each_token_at_its_slot_with_rollover():
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=3, dtype=torch.float32, device="cpu")
    # sequence A fills block 5 (offsets 1..3) and rolls over into block 2; sequence B writes into block 0
    slots = torch.tensor([5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1, 0 * 4 + 3], dtype=torch.int64)
    key = torch.randn(6, 2, 3)
    value = torch.randn(6, 2, 3)
    write_kv(cache.layer(1), key, value, slots)
    expected = torch.zeros_like(cache.kv)
    for t, slot in enumerate(slots.tolist()):
        expected[1, 0, slot // 4, slot % 4] = key[t]
        expected[1, 1, slot // 4, slot % 4] = value[t]
    assert torch.equal(cache.kv, expected)
    assert cache.layer(1).shape == (2, 6, 4, 2, 3)


def test_copy_blocks_copies_every_layer_exactly():
    cache = PagedKVCache(num_layers=3, num_blocks=5, block_size=2, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")
    cache.kv.copy_(torch.randn_like(cache.kv))
    before = cache.kv.clone()
    # block 1 is both read (-> 3) and overwritten (from 4): sources are read before any write
    cache.copy_blocks([(1, 3), (4, 1), (0, 2)])
    expected = before.clone()
    expected[:, :, 3] = before[:, :, 1]
    expected[:, :, 1] = before[:, :, 4]
    expected[:, :, 2] = before[:, :, 0]
    assert torch.equal(cache.kv, expected)
    cache.copy_blocks([])
    assert torch.equal(cache.kv, expected)


def test_budget_sizing():
    per_block = PagedKVCache.bytes_per_block(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    assert per_block == 30 * 2 * 16 * 3 * 64 * 2
    assert PagedKVCache.bytes_per_block(2, 4, 1, 8, torch.float32) == 2 * 2 * 4 * 8 * 4
    assert PagedKVCache.num_blocks_for_budget(per_block * 10 + per_block - 1, 30, 16, 3, 64, torch.bfloat16) == 10
    assert PagedKVCache.num_blocks_for_budget(per_block - 1, 30, 16, 3, 64, torch.bfloat16) == 0
    cache = PagedKVCache(num_layers=30, num_blocks=10, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16, device="cpu")
    assert cache.kv.numel() * cache.kv.element_size() == 10 * per_block


def _run_case(block_size: int, num_kv_heads: int, group: int, query_lens: list[int], seq_lens: list[int],
              shared_prefix_blocks: int = 0, seed: int = 0) -> None:
    """Random contexts laid out in shuffled blocks; the scheduled chunk is written with write_kv, the
    rest pre-filled; compares paged_attention_ref against dense attention per sequence."""
    gen = torch.Generator().manual_seed(seed)
    head_dim, num_heads = 8, num_kv_heads * group
    blocks_needed = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_ids: list[list[int]] = []
    for need in blocks_needed:
        block_ids.append([perm.pop() for _ in range(need)])
    keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
    if shared_prefix_blocks:
        # sequence 1 shares sequence 0's first blocks (a prefix-cache hit): same block ids, same K/V
        n = shared_prefix_blocks * block_size
        block_ids[1][:shared_prefix_blocks] = block_ids[0][:shared_prefix_blocks]
        keys[1][:n], values[1][:n] = keys[0][:n], values[0][:n]
        assert query_lens[0] <= seq_lens[0] - n and query_lens[1] <= seq_lens[1] - n
    cache = PagedKVCache(1, num_blocks, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    kv = cache.layer(0)
    for seq, seq_len in enumerate(seq_lens):  # the cached context before the chunk
        for pos in range(seq_len - query_lens[seq]):
            block = block_ids[seq][pos // block_size]
            kv[0, block, pos % block_size] = keys[seq][pos]
            kv[1, block, pos % block_size] = values[seq][pos]
    meta = make_metadata(query_lens, seq_lens, block_ids, block_size)
    new_keys = torch.cat([k[s - q :] for k, s, q in zip(keys, seq_lens, query_lens)])
    new_values = torch.cat([v[s - q :] for v, s, q in zip(values, seq_lens, query_lens)])
    write_kv(kv, new_keys, new_values, meta.slot_mapping)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = paged_attention_ref(query, kv, meta, scale)
    dispatched = paged_attention(query, kv, meta, scale)  # the C kernel on CPU when it builds
    start = 0
    for seq, q_len in enumerate(query_lens):
        expected = dense_attention(query[start : start + q_len], keys[seq], values[seq], scale)
        torch.testing.assert_close(out[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(dispatched[start : start + q_len], expected, atol=1e-5, rtol=1e-5)
        start += q_len


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_mixed_batch(block_size: int, group: int):
    b = block_size
    query_lens = [1, 1, 7, 1, 40, 1, 1, 7, 40]
    seq_lens = [
        b,  # decode ending exactly on a block boundary
        b + 1,  # decode just past a boundary
        2 * b + 7,  # chunk after a cached prefix
        1,  # one-token prompt
        40,  # whole prompt as one chunk (q_len == seq_len)
        3 * b + 5,
        4 * b,
        7,  # whole short prompt
        2 * b + 40,  # long chunk after a prefix, ends mid-block
    ]
    _run_case(block_size, num_kv_heads=2, group=group, query_lens=query_lens, seq_lens=seq_lens, seed=block_size + group)


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_chunk_of_one_and_boundaries(block_size: int):
    b = block_size
    # a chunk of 1 is a decode; chunks that end exactly on and just past a block boundary
    _run_case(block_size, 1, 3, query_lens=[1, 7, 7, 40, 40], seq_lens=[3 * b, 2 * b, 2 * b + 1, 40 + b, 40 + b + 1], seed=7)


@pytest.mark.parametrize("group", [1, 3])
def test_paged_attention_shared_prefix_blocks(group: int):
    # two sequences share two full prefix blocks; one decodes, the other prefills its tail
    _run_case(4, 2, group, query_lens=[1, 7], seq_lens=[11, 15], shared_prefix_blocks=2, seed=3)
    _run_case(16, 2, group, query_lens=[40, 1], seq_lens=[72, 33], shared_prefix_blocks=2, seed=4)


def test_paged_attention_many_decodes_grouped(monkeypatch):
    # more decode context than one gather group holds: the grouping must not change results
    import kvcache.paged as paged

    monkeypatch.setattr(paged, "_DECODE_GATHER_TOKENS", 64)
    _run_case(4, 2, 2, query_lens=[1] * 9, seq_lens=[30, 1, 17, 64, 5, 33, 12, 8, 50], seed=11)
