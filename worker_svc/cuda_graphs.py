"""CUDA graphs for decode-only steps.

A small model's decode step on a GPU is dominated by kernel launches. At start the worker
captures the forward pass plus the logits for a ladder of batch sizes (1, 2, 4, ... up to
``max_batch``); a decode-only step whose batch fits is padded up to the next captured size and
replayed with one launch. Prefill and mixed steps run eagerly.

What a graph reads lives in static buffers sized for the largest batch: input ids, positions,
slot mapping, context lengths, block tables. The first four are views of one device buffer, which
a step fills with its one host-to-device copy; the block tables are gathered into theirs on the
device. Padding rows write nowhere (slot -1, which the Triton append kernel skips) and attend
over one key of whatever block their stale table row names; their logits are never sampled. The
attention grid depends only on host integers fixed at capture (``max_query_len`` 1,
``max_seq_len`` = the model length, which picks the key-split count; splits past a shorter
context are empty and merge to nothing), so one graph serves every context length.

With ``capture=False`` the same padded static-buffer path runs eagerly: tests run it on CPU
with the Triton kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvcache.paged import AttentionMetadata, PagedKVCache
from worker_svc.step_io import ALIGN, Section, aligned

log = logging.getLogger("pagewire.worker")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def compile_attention_kernels(model: torch.nn.Module, kv_cache: PagedKVCache) -> None:
    """Compile the Triton attention kernels' variants for the attention layers of ``model`` over
    ``kv_cache`` before the first step (``kvcache.triton_attention.warm_up``); nothing where the steps do not run them."""
    from kvcache.paged import uses_triton
    from worker_svc.layers.attention import PagedAttention

    if kv_cache.device.type != "cuda" or not uses_triton(kv_cache.kv):
        return  # Triton's interpreter (CPU tensors) compiles nothing
    from kvcache.triton_attention import warm_up

    t0 = time.monotonic()
    head_counts = {m.num_heads for m in model.modules() if isinstance(m, PagedAttention)}
    launches = sum(warm_up(num_heads, kv_cache.layer(0)) for num_heads in head_counts)
    if kv_cache.device.type == "cuda":
        torch.cuda.synchronize(kv_cache.device)
    log.info("compiled %d attention kernel variants in %.1fs", launches, time.monotonic() - t0)


def batch_ladder(max_batch: int) -> list[int]:
    """Captured sizes: the powers of two up to ``max_batch``, plus ``max_batch`` itself."""
    sizes = [b for b in GRAPH_BATCH_SIZES if b < max_batch]
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: PagedKVCache,
        max_batch: int,
        max_model_len: int,
        max_blocks_per_seq: int,
        device: torch.device,
        capture: bool = True,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = batch_ladder(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.capture = capture
        b, dev = self.max_batch, self.device
        # the static inputs a step writes (ids, positions, slots, context lengths) are views at
        # fixed offsets of one device buffer, so one host-to-device copy fills them
        # (worker_svc.step_io); what a step stages besides them goes after static_end
        # (the rows of the block tables, and input ids to take from the device: 24 bytes a row)
        sizes = (8 * b, 8 * b, 8 * b, 4 * b)  # ids, positions, slots (int64), context lengths (int32)
        offsets = [0]
        for size in sizes:
            offsets.append(aligned(offsets[-1] + size))
        self.offsets, self.static_end = tuple(offsets[:4]), offsets[4]
        self.inputs = torch.zeros(self.static_end + aligned(24 * b) + 3 * ALIGN, dtype=torch.uint8, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = (
            self.inputs[o : o + n].view(dtype) for o, n, dtype in zip(
                self.offsets, sizes, (torch.int64, torch.int64, torch.int64, torch.int32)))
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables = torch.zeros((b, max_blocks_per_seq), dtype=torch.int32, device=dev)  # [b, max_blocks]
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)  # one query per sequence
        self.logits_indices = torch.arange(b, dtype=torch.int64, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # size -> [size, vocab] fp32 output of the graph
        self.num_replays = 0

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            logits_indices=self.logits_indices[:size],
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_cache, self._meta(size))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up (compile kernels) and capture every size, largest first, in one memory pool."""
        if not self.capture:
            return
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            for _ in range(2):  # Triton JIT and allocator warm-up outside the capture
                self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._logits[size] = self._forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured CUDA graphs for decode batches %s in %.1fs", self.sizes, time.monotonic() - t0)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def padded_size(self, num_seqs: int) -> int:
        return next(s for s in self.sizes if s >= num_seqs)

    def sections(self, size: int, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
                 seq_lens: np.ndarray) -> list[Section]:
        """A decode step's host arrays (S rows) padded to ``size`` rows, at the static buffers'
        offsets of ``inputs``: padding rows write nowhere (slot -1) and attend over one key."""
        n = input_ids.shape[0]
        pads = ((input_ids, 0, torch.int64), (positions, 0, torch.int64), (slot_mapping, -1, torch.int64),
                (seq_lens, 1, torch.int32))
        out = []
        for (array, pad, dtype), offset in zip(pads, self.offsets):
            if size > n:
                array = np.concatenate((array, np.full(size - n, pad, dtype=array.dtype)))
            out.append(Section(array, dtype, offset))
        return out

    @torch.inference_mode()
    def replay(self, n: int, size: int) -> torch.Tensor:
        """Logits [n, vocab] (fp32) of a decode step whose inputs are in the static buffers (rows
        ``n`` to ``size`` padding), by the graph captured for ``size`` rows."""
        self.num_replays += 1
        graph = self._graphs.get(size)
        if graph is None:  # capture=False: the same padded path, eagerly
            return self._forward(size)[:n]
        graph.replay()
        return self._logits[size][:n]
