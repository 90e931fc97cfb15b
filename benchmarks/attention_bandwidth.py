"""Paged-attention decode bandwidth: the Triton kernel (and the torch reference) on one CUDA GPU.
Feeds docs/benchmarks.md, section "9. NVIDIA H200: seed workload and attention bandwidth" (GPU: needs a CUDA machine).

    python benchmarks/attention_bandwidth.py [--batch 64] [--context 2048] [--block-size 16]
        [--dtype bfloat16] [--models smollm2 gpt2] [--num-splits auto 1] [--peak-gbps GB/s]
        [--sweep] [--sweep-seconds 60] [--json PATH]

A decode step of --batch sequences, each with one query and --context keys, in one layer's paged
cache of --block-size token blocks laid out in random block order (as after a while of serving).
Shapes: smollm2 = SmolLM2-135M (9 query heads, 3 KV heads, head_dim 64), llama1b = Llama-3.2-1B
(32 / 8 / 64), gpt2 = GPT-2 small (12 / 12 / 64). The kernel is timed with CUDA events over a CUDA graph of back-to-back calls, so the
number is GPU time, not Python launch cost; --num-splits times the key-split heuristic ("auto") and
fixed split counts. Bytes moved = K and V of every context token + the queries and outputs (the block
table is ignored: 4 bytes per block). Achieved bandwidth is reported as GB/s and as a fraction of
--peak-gbps, which defaults by GPU name (H100 SXM 3350, H100 PCIe 2000, H200 4800, ...). The torch
reference (the CPU production path) runs eagerly, for comparison.

--sweep searches the launch for each shape instead: key splits first (1, 2, 3, 4, 6, 8, 12 with the
default tiles), then one tile knob at a time (keys per tile, warps, pipeline stages) from the best so
far, keeping a change that is faster, until nothing improves, then splits 2-6 with 64 or 128 keys
per tile and 2 or 4 warps together, while --sweep-seconds per shape last (each new launch shape
compiles). It prints every trial and the best against the default launch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

MODELS = {  # name: (num_heads, num_kv_heads, head_dim)
    "smollm2": (9, 3, 64),
    "llama1b": (32, 8, 64),
    "gpt2": (12, 12, 64),
}

# Peak DRAM bandwidth in GB/s by a substring of torch.cuda.get_device_name(); first match wins.
PEAK_GBPS = [
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM
    ("H200", 4800.0),
    ("GH200", 4000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_peak_gbps(device_name: str) -> float | None:
    for key, gbps in PEAK_GBPS:
        if key in device_name:
            return gbps
    return None


def make_decode_batch(batch: int, context: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device):
    """query [batch, H, D], kv_layer [2, N, block_size, Hkv, D] and metadata for one decode step."""
    from kvcache.paged import AttentionMetadata

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1  # block 0 pads table rows
    generator = torch.Generator(device="cpu").manual_seed(0)
    order = torch.randperm(num_blocks - 1, generator=generator) + 1
    block_tables = order.view(batch, blocks_per_seq).to(torch.int32)  # [batch, blocks_per_seq]
    kv_layer = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), device=device, dtype=dtype)
    query = torch.randn((batch, num_heads, head_dim), device=device, dtype=dtype)
    positions = torch.full((batch,), context - 1, dtype=torch.int64)
    slots = block_tables[torch.arange(batch), positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32).to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device),
        max_query_len=1,
        max_seq_len=context,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
        logits_indices=torch.arange(batch, dtype=torch.int64).to(device),
    )
    return query, kv_layer, meta


def time_graph(fn, calls_per_graph: int, replays: int) -> float:
    """Seconds per call of ``fn`` (GPU time): a CUDA graph of back-to-back calls, replayed, timed with events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile and warm up outside the graph
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls_per_graph)


def time_eager(fn, iters: int) -> float:
    """Seconds per call of ``fn`` run eagerly (includes host work the call waits for)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12)
SWEEP_KNOBS = {"block_n": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5)}


def sweep(time_call, default_tiles, default_splits: int, seconds: float, log) -> dict:
    """Coordinate search over (splits, tiles): ``time_call(splits, tiles)`` -> seconds per call. The
    default launch is timed first; a trial that fails to compile or run is logged and skipped."""
    deadline = time.monotonic() + seconds
    trials: dict = {}

    def trial(splits: int, tiles) -> float | None:
        key = (splits, tuple(tiles))
        if key not in trials:
            try:
                trials[key] = time_call(splits, tiles)
            except Exception as exc:  # noqa: BLE001 - a launch shape that does not compile (e.g. shared memory)
                trials[key] = None
                log(f"  s={splits} {tiles}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
                return None
            log(f"  s={splits} block_n={tiles.block_n} warps={tiles.num_warps} stages={tiles.num_stages}: "
                f"{trials[key] * 1e6:.1f} us")
        return trials[key]

    default_s = trial(default_splits, default_tiles)
    best = (default_s, default_splits, default_tiles)

    def consider(splits: int, tiles) -> bool:
        nonlocal best
        t = trial(splits, tiles) if time.monotonic() < deadline else None
        if t is not None and (best[0] is None or t < best[0] * 0.99):
            best = (t, splits, tiles)
            return True
        return False

    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for splits in SWEEP_SPLITS:
            improved |= consider(splits, best[2])
        for knob, values in SWEEP_KNOBS.items():
            for value in values:
                improved |= consider(best[1], best[2]._replace(**{knob: value}))
    # then the pairs the one-knob walk cannot reach: splits with keys per tile and warps together
    for splits in SWEEP_SPLITS[1:5]:
        for block_n in SWEEP_KNOBS["block_n"][1:]:
            for num_warps in SWEEP_KNOBS["num_warps"][:2]:
                consider(splits, best[2]._replace(block_n=block_n, num_warps=num_warps))
    return {
        "default": {"splits": default_splits, "tiles": default_tiles._asdict(), "us": default_s and default_s * 1e6},
        "best": {"splits": best[1], "tiles": best[2]._asdict(), "us": best[0] and best[0] * 1e6},
        "trials": [{"splits": k[0], "tiles": list(k[1]), "us": v and v * 1e6} for k, v in trials.items()],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="decoding sequences (default 64)")
    ap.add_argument("--context", type=int, default=2048, help="keys per sequence (default 2048)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per cache block (default 16)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="cache and query dtype (default bfloat16)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="head shapes to time (default: all)")
    ap.add_argument(
        "--num-splits", nargs="+", default=["auto", "1"],
        help="key splits to time: 'auto' (the heuristic) and/or fixed counts (default: auto 1)",
    )
    ap.add_argument("--peak-gbps", type=float, default=None, help="peak memory bandwidth in GB/s (default: by GPU name)")
    ap.add_argument("--calls-per-graph", type=int, default=20, help="kernel calls captured in one CUDA graph (default 20)")
    ap.add_argument("--replays", type=int, default=20, help="timed graph replays (default 20)")
    ap.add_argument("--ref-iters", type=int, default=5, help="timed calls of the torch reference; 0 skips it (default 5)")
    ap.add_argument("--sweep", action="store_true", help="search splits and tiles per shape (see above)")
    ap.add_argument("--sweep-seconds", type=float, default=60.0, help="time per shape for --sweep (default 60)")
    ap.add_argument("--json", default=None, metavar="PATH", help="write every figure here")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        print("attention_bandwidth: no CUDA device found; this benchmark times GPU kernels, run it on a GPU machine.", file=sys.stderr)
        return 1
    try:
        from kvcache.triton_attention import Tiles, paged_attention_triton, plan_launch
    except ImportError as exc:
        print(f"attention_bandwidth: Triton is not importable ({exc}); install the 'triton' extra.", file=sys.stderr)
        return 1
    from kvcache.paged import paged_attention_ref

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_gbps or default_peak_gbps(name)
    dtype = DTYPES[args.dtype]
    print(f"{name}; peak {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}; {args.dtype}, "
          f"batch {args.batch} x {args.context} keys decode, block size {args.block_size}")
    print(f"{'model':8} {'H/Hkv/D':>9} {'kernel':>17} {'us/call':>9} {'GB/s':>8} {'of peak':>8} {'max err':>9}")
    record: dict = {"device": name, "peak_gbps": peak, "dtype": args.dtype, "batch": args.batch,
                    "context": args.context, "block_size": args.block_size, "models": {}}

    for model in args.models:
        num_heads, num_kv_heads, head_dim = MODELS[model]
        query, kv_layer, meta = make_decode_batch(
            args.batch, args.context, args.block_size, num_heads, num_kv_heads, head_dim, dtype, device
        )
        element = query.element_size()
        moved = (2 * args.batch * args.context * num_kv_heads * head_dim + 2 * query.numel()) * element
        scale = head_dim**-0.5
        expected = paged_attention_ref(query.float(), kv_layer.float(), meta, scale)
        shape = f"{num_heads}/{num_kv_heads}/{head_dim}"

        rows = record["models"].setdefault(model, {"shape": shape, "bytes": moved, "kernels": {}})["kernels"]

        def report(label: str, seconds: float, out: torch.Tensor) -> None:
            gbps = moved / seconds / 1e9
            fraction = f"{gbps / peak:8.1%}" if peak else f"{'-':>8}"
            error = (out.float() - expected).abs().max().item()
            print(f"{model:8} {shape:>9} {label:>17} {seconds * 1e6:9.1f} {gbps:8.0f} {fraction} {error:9.2e}", flush=True)
            rows[label] = {"us": seconds * 1e6, "gbps": gbps, "of_peak": gbps / peak if peak else None, "max_err": error}

        if args.sweep:
            default = plan_launch(query, num_kv_heads, meta)
            default_tiles = Tiles(default.block_m, default.block_n, default.num_warps, default.num_stages)

            def time_call(splits, tiles):
                def call():
                    return paged_attention_triton(query, kv_layer, meta, scale, num_splits=splits, tiles=tiles)

                error = (call().float() - expected).abs().max().item()
                if not error < 5e-2:
                    raise ValueError(f"max error {error:.2e}")
                return time_graph(call, args.calls_per_graph, args.replays)

            found = sweep(time_call, default_tiles, default.num_splits, args.sweep_seconds,
                          lambda line: print(f"{model:8} {line}", flush=True))
            record["models"][model]["sweep"] = found
            for which in ("default", "best"):
                if found[which]["us"]:
                    gbps = moved / found[which]["us"] / 1e3
                    print(f"{model:8} {shape:>9} sweep {which}: s={found[which]['splits']} {found[which]['tiles']} "
                          f"{found[which]['us']:.1f} us {gbps:.0f} GB/s" + (f" {gbps / peak:.1%}" if peak else ""), flush=True)
            continue

        for splits in args.num_splits:
            num_splits = None if splits == "auto" else int(splits)
            chosen = plan_launch(query, num_kv_heads, meta, num_splits).num_splits

            def call(num_splits=num_splits):
                return paged_attention_triton(query, kv_layer, meta, scale, num_splits=num_splits)

            label = f"triton s={chosen}" + (" (auto)" if num_splits is None else "")
            report(label, time_graph(call, args.calls_per_graph, args.replays), call())
        if args.ref_iters > 0:

            def call_ref():
                return paged_attention_ref(query, kv_layer, meta, scale)

            report("torch ref", time_eager(call_ref, args.ref_iters), call_ref())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
