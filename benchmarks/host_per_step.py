"""The host's work per step, phase by phase, in every process, on a model whose forward pass costs
next to nothing. Feeds docs/benchmarks.md, section "10. The host's work per step".

    python benchmarks/host_per_step.py [--seqs 64,256] [--workloads decode,mixed] [--paths offline,served]
        [--profile-steps 16] [--repeats 2] [--json PATH]

On a GPU a small model's step is 0.2-0.65 ms of device work, and the step takes what the host
spends around it: scheduling, the links, applying the plan, building the input tensors, launching
the kernels, the sampled ids' trip to the host, encoding, delivery to the API servers. This
script measures that host work with the step profile (``--profile-steps N``,
``pagewire_common.step_profile``) on a random 1-layer Llama (hidden 64, 2 heads, vocab 512) with
the embedded SmolLM2's tokenizer, built into a temp folder, so that the forward pass is nearly
free and what is left is the host's.

Workloads, each at every ``--seqs`` count of running sequences (closed loop):
- decode: ``--seqs`` requests of 16-token prompts and 128 new tokens (ignore_eos), all at once;
- mixed: 4 x ``--seqs`` requests of 128-token prompts and 16 new tokens, ``--seqs`` in flight,
  so new prompts are prefilled while others decode.

Paths:
- offline: ``pagewire.LLM(profile_steps=N)`` (``max_num_seqs`` = the count), read with
  ``LLM.profile()`` after a warm-up, with the garbage collector's objects frozen (``gc.freeze()``)
  as the served processes freeze theirs;
- served: ``pagewire serve --profile-steps N`` driven by ``pagewire bench --addr`` (one client
  process, concurrency = the count); the ``step profile`` lines that the worker, the core and the
  API server log during the measured run are summed per process, without each process's first
  window of the run (it holds steps, and idle time, from before it).

For each it reports, per process and per phase, µs per step and µs per token (a sampled token),
the process's wall and CPU time per step and the tokens per step, of the fastest of ``--repeats``
runs. Everything shares this host's cores, the bench client included. Linux; about half a minute
on 2 cores with the defaults.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagewire.bench.report import environment
from pagewire.bench.server import ServedServer, free_port
from pagewire_common.step_profile import parse_line
from pagewire_common.wire import TOKENIZER_FILES

VOCAB_SIZE = 512
FIRST_ORDINARY_ID = 17  # SmolLM2's special tokens are ids 0-16
WORKLOADS = {
    # name: (requests per running sequence, prompt tokens, new tokens)
    "decode": (1, 16, 128),
    "mixed": (4, 128, 16),
}
PATHS = ("offline", "served")


def build_model(out_dir: Path, tokenizer_dir: Path | None = None) -> Path:
    """A random-weight 1-layer Llama with the embedded SmolLM2's tokenizer (or the one in
    ``tokenizer_dir``), cut to its first ``VOCAB_SIZE`` ids (the worker's grammar matcher wants no
    more tokens than the model has)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker_svc.weights import resolve_model_path

    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    embedded = tokenizer_dir or resolve_model_path(None)
    for name in TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copy(embedded / name, out_dir / name)
    # byte-level BPE: ids below 512 are the specials, the 256 bytes and the first merges; keep the
    # merges that make a kept token from kept tokens, and those ids decode as they did
    tokenizer = json.loads((out_dir / "tokenizer.json").read_text())
    bpe = tokenizer["model"]
    bpe["vocab"] = {piece: i for piece, i in bpe["vocab"].items() if i < VOCAB_SIZE}
    bpe["merges"] = [m for m in bpe["merges"] if all(p in bpe["vocab"] for p in (*m, "".join(m)))]
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < VOCAB_SIZE]
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    return out_dir


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, VOCAB_SIZE) for _ in range(length)] for _ in range(n)]


def figures(profile: dict) -> dict:
    """A process's summed profile as the report keeps it."""
    steps, tokens = profile["steps"], profile["tokens"]
    return {
        "steps": steps, "tokens": tokens,
        "tokens_per_step": round(tokens / steps, 1) if steps else None,
        "wall_us_per_step": round(profile["wall_us"] / steps, 1) if steps else None,
        "cpu_us_per_step": round(profile["cpu_us"] / steps, 1) if steps else None,
        "phases": {name: {"us_per_step": round(p["total_us"] / steps, 1) if steps else None,
                          "us_per_token": round(p["total_us"] / tokens, 2) if tokens else None}
                   for name, p in profile["phases"].items()},
    }


def run_offline(model_dir: Path, args) -> dict:
    from pagewire import LLM, SamplingParams

    results: dict = {}
    for seqs in args.seqs:
        llm = LLM(model_dir, profile_steps=args.profile_steps, max_num_seqs=seqs, dtype=args.dtype,
                  num_threads=args.num_threads)
        args.dtype_resolved = str(llm.runner.dtype).removeprefix("torch.")
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate(prompts(seqs, 16, seed=1), warm)
        # as each served process does once ready: a full collection of everything torch and the
        # model hold would otherwise land in one step (about 280 ms once a run on a 2-core VM)
        gc.collect()
        gc.freeze()
        for workload in args.workloads:
            per_seq, prompt_len, new_tokens = WORKLOADS[workload]
            sampling = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            runs = []
            for repeat in range(args.repeats):
                seed = seqs * 100 + list(WORKLOADS).index(workload) * 10 + repeat + 1  # no prefix cache hits
                batch = prompts(per_seq * seqs, prompt_len, seed=seed)
                llm.profile(reset=True)
                start = time.perf_counter()
                llm.generate(batch, sampling)
                elapsed = time.perf_counter() - start
                profile = llm.profile()
                runs.append({"tok_s": round(profile["tokens"] / elapsed, 1),
                             "processes": {"offline": figures(profile)}})
            results.setdefault(workload, {})[seqs] = fastest(runs)
            print(f"offline {workload} {seqs}: {[r['tok_s'] for r in runs]} tok/s", file=sys.stderr)
        llm.close()
        gc.unfreeze()
    return results


def fastest(runs: list[dict]) -> dict:
    """The run least disturbed by the rest of the machine, with every run's throughput."""
    best = max(runs, key=lambda r: r["tok_s"] or 0)
    return {**best, "tok_s_of_runs": [r["tok_s"] for r in runs]}


def bench(addr: str, model_dir: Path, num_requests: int, concurrency: int, prompt_len: int, new_tokens: int,
          seed: int = 0) -> str:
    argv = [sys.executable, "-m", "pagewire.cli", "bench", "--addr", addr, "--model", str(model_dir),
            "--seed", str(seed), "--num-requests", str(num_requests), "--concurrency", str(concurrency),
            "--prompt-len", str(prompt_len), "--max-new-tokens", str(new_tokens), "--ignore-eos", "--warmup-runs", "0",
            "--no-progress"]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"pagewire bench failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


def sum_windows(log_text: str) -> dict[str, dict]:
    """The logged windows of each process summed, less each process's first (role -> profile; a
    role with several processes, like API servers, is summed over them)."""
    seen: set[tuple[str, int]] = set()
    summed: dict[str, dict] = {}
    for line in log_text.splitlines():
        window = parse_line(line)
        if window is None:
            continue
        key = (window["role"], window["pid"])
        if key not in seen:
            seen.add(key)
            continue
        total = summed.setdefault(window["role"], {"steps": 0, "tokens": 0, "wall_us": 0.0, "cpu_us": 0.0,
                                                   "phases": {}})
        for key in ("steps", "tokens", "wall_us", "cpu_us"):
            total[key] += window[key]
        for name, p in window["phases"].items():
            total["phases"].setdefault(name, {"total_us": 0.0})["total_us"] += p["total_us"]
    return summed


def run_served(model_dir: Path, args, log_path: Path) -> dict:
    addr = f"127.0.0.1:{free_port()}"
    server = ServedServer([sys.executable, "-m", "pagewire.cli", "serve", "--model", str(model_dir), "--listen", addr,
                           "--http-listen", "off", "--dtype", args.dtype, "--num-threads", str(args.num_threads),
                           "--max-num-seqs", str(max(args.seqs)),
                           "--profile-steps", str(args.profile_steps)], addr, log_path=str(log_path))
    server.start(timeout=300)
    results: dict = {}
    try:
        bench(addr, model_dir, 64, 32, 16, 16)  # warm up
        for seqs in args.seqs:
            for workload in args.workloads:
                per_seq, prompt_len, new_tokens = WORKLOADS[workload]
                runs = []
                for repeat in range(args.repeats):
                    offset = len(log_path.read_text(errors="replace"))
                    seed = seqs * 100 + list(WORKLOADS).index(workload) * 10 + repeat + 1  # no prefix cache hits
                    out = bench(addr, model_dir, per_seq * seqs, seqs, prompt_len, new_tokens, seed=seed)
                    time.sleep(0.5)  # the last lines reach the log
                    rates = re.findall(r"([\d,]+\.\d) output tok/s", out)
                    summed = sum_windows(log_path.read_text(errors="replace")[offset:])
                    runs.append({"tok_s": float(rates[0].replace(",", "")) if rates else None,
                                 "processes": {role: figures(p) for role, p in sorted(summed.items())}})
                results.setdefault(workload, {})[seqs] = fastest(runs)
                print(f"served {workload} {seqs}: {[r['tok_s'] for r in runs]} tok/s", file=sys.stderr)
    finally:
        server.stop()
    return results


def print_table(path: str, results: dict, seqs: list[int], workloads: list[str]) -> None:
    columns = [(w, s) for w in workloads for s in seqs if s in results.get(w, {})]
    print(f"\n{path}: µs per step (µs per token)")
    print("| process | phase | " + " | ".join(f"{w} {s}" for w, s in columns) + " |")
    print("| --- | --- | " + " | ".join("---:" for _ in columns) + " |")
    rows: dict[tuple[str, str], list[str]] = {}
    for i, (w, s) in enumerate(columns):
        run = results[w][s]
        rows.setdefault(("", "tok/s"), [""] * len(columns))[i] = f"{run['tok_s']:,.0f}" if run["tok_s"] else "?"
        for role, proc in run["processes"].items():
            rows.setdefault((role, "tokens per step"), [""] * len(columns))[i] = f"{proc['tokens_per_step']}"
            rows.setdefault((role, "wall per step"), [""] * len(columns))[i] = f"{proc['wall_us_per_step']:,.0f}"
            rows.setdefault((role, "CPU per step"), [""] * len(columns))[i] = f"{proc['cpu_us_per_step']:,.0f}"
            for name, p in proc["phases"].items():
                rows.setdefault((role, name), [""] * len(columns))[i] = f"{p['us_per_step']:,.1f} ({p['us_per_token']})"
    for (role, name), cells in rows.items():
        print(f"| {role} | {name} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="64,256", help="running sequences, comma-separated (default: %(default)s)")
    parser.add_argument("--workloads", default="decode,mixed", help="decode, mixed or both (default: %(default)s)")
    parser.add_argument("--paths", default="offline,served", help="offline, served or both (default: %(default)s)")
    parser.add_argument("--profile-steps", type=int, default=16,
                        help="steps per logged window of each served process (its first window of a run is "
                        "left out); offline reads its totals (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", help="the model's dtype, as --dtype (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each measurement; the fastest is reported, the others' tok/s beside it "
                        "(default: %(default)s)")
    parser.add_argument("--num-threads", type=int, default=1,
                        help="the worker's torch threads: one, as the model's ops are too small to split, and on a "
                        "busy host a team of threads waits for its slowest (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write every figure and the environment here")
    parser.add_argument("--tokenizer", default=None, metavar="DIR", type=Path,
                        help="take SmolLM2's tokenizer files from DIR, on a machine without the embedded model "
                        "(default: the embedded model)")
    parser.add_argument("--server-log", default=None, metavar="PATH",
                        help="keep the served path's log here (default: a temp file, removed)")
    args = parser.parse_args()
    args.seqs = [int(s) for s in args.seqs.split(",")]
    args.workloads = [w for w in args.workloads.split(",") if w]
    paths = [p for p in args.paths.split(",") if p]
    if set(args.workloads) - set(WORKLOADS) or set(paths) - set(PATHS) or min(args.seqs) < 1 or args.repeats < 1:
        parser.error("--workloads takes decode,mixed; --paths offline,served; --seqs and --repeats positive counts")
    report: dict = {"command": " ".join(sys.argv), "profile_steps": args.profile_steps, "dtype": args.dtype,
                    "num_threads": args.num_threads, "repeats": args.repeats, "workloads": {w: dict(zip(
                        ("requests_per_running_seq", "prompt_tokens", "new_tokens"), WORKLOADS[w])) for w in WORKLOADS},
                    "results": {}}
    with tempfile.TemporaryDirectory(prefix="pagewire-host-per-step-") as tmp:
        model_dir = build_model(Path(tmp) / "model", args.tokenizer)
        if "offline" in paths:
            report["results"]["offline"] = run_offline(model_dir, args)
            report["dtype_resolved"] = args.dtype_resolved
        if "served" in paths:
            log_path = Path(args.server_log) if args.server_log else Path(tmp) / "serve.log"
            report["results"]["served"] = run_served(model_dir, args, log_path)
    report["environment"] = environment()
    for path, results in report["results"].items():
        print_table(path, results, args.seqs, args.workloads)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
