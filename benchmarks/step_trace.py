"""Where a stream's inter-token latency comes from: section 2's workload run in one process (the
engine and the model runner, no gRPC) on the wall clock, with every step timed and described.

    python benchmarks/step_trace.py [--pacing 0,64] [--request-rate 1.0] [--num-requests 64]
        [--max-num-batched-tokens 32] [--dtype float32] [--json PATH]

Requests arrive as Poisson arrivals (prompts of 16-512 random tokens, 64 new tokens, ignore EOS;
driven by benchmarks/replay.py); the engine steps without overlap, so each step's time is the
worker's. For each setting it prints TTFT and ITL percentiles as `pagewire bench` computes them,
the step times of decode-only steps, of steps carrying prompt tokens and of full-budget steps
(all the same size, so their spread is the machine's: also whether it comes in spikes or in
slow and fast periods), and a least-squares fit
of the step time to a fixed cost, a cost per scheduled token and a cost per context token the
decodes read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.replay import poisson_arrivals, replay  # noqa: E402
from pagewire.bench.metrics import percentile  # noqa: E402
from pagewire.llm import LLM  # noqa: E402
from pagewire_common.sampling import SamplingParams  # noqa: E402
from scheduler_svc.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine import EngineCore  # noqa: E402


class WallClock:
    """Real time from the first arrival on; each step is the model runner's, timed."""

    def __init__(self, engine: EngineCore, runner):
        self.engine = engine
        self.runner = runner
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def idle_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def execute(self, plan):
        """Also records (seconds, scheduled tokens, decodes, their context tokens, prompt tokens)."""
        seqs = self.engine.scheduler.seqs
        decodes = [d for d in plan.running_seqs if d.num_scheduled_tokens == 1]
        context = sum(seqs[d.seq_id].num_computed_tokens for d in decodes if d.seq_id in seqs)
        started = time.perf_counter()
        result = self.runner.execute(plan)
        done = time.perf_counter()
        record = (done - started, plan.num_scheduled_tokens, len(decodes), context,
                  plan.num_scheduled_tokens - len(decodes))
        return result, done - self.t0, record


def full_step_drift(full: np.ndarray, window: int = 50) -> dict:
    """Whether full-budget steps vary as one-off spikes or as slow and fast periods: the lag-1
    autocorrelation of their times against a fit on their decodes and context (near 0 for
    spikes), and the medians of ``window`` consecutive full steps."""
    if len(full) < 2 * window:
        return {"full_step_residual_lag1": float("nan"), "full_step_window_medians_ms": []}
    design = np.c_[np.ones(len(full)), full[:, 2], full[:, 3]]
    fit, *_ = np.linalg.lstsq(design, full[:, 0], rcond=None)
    residual = full[:, 0] - design @ fit
    medians = [float(np.median(full[i:i + window, 0])) * 1e3 for i in range(0, len(full) - window + 1, window)]
    return {"full_step_residual_lag1": float(np.corrcoef(residual[:-1], residual[1:])[0, 1]),
            "full_step_window_medians_ms": medians}


def run(llm: LLM, pacing: int, args) -> dict:
    base = llm.engine
    config = SchedulerConfig(max_model_len=base.config.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_num_seqs=256, prefill_pacing_steps=pacing)
    engine = EngineCore(config, base.worker_info, llm.runner)
    arrivals = poisson_arrivals(args.seed, args.num_requests, args.request_rate, (16, 512), (1000, 20000))
    sampling = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    traced = replay(engine, arrivals, sampling, WallClock(engine, llm.runner))
    ttft, itl, steps = traced.ttft, traced.itl, traced.steps
    while (plan := engine.schedule()) is not None:  # the worker drops the last finished sequences
        engine.process_result(llm.runner.execute(plan))
    engine.allocator.check_integrity()
    s = np.array(steps)
    fit, *_ = np.linalg.lstsq(np.c_[np.ones(len(s)), s[:, 1], s[:, 3]], s[:, 0], rcond=None)
    prefill = s[:, 4] > 0
    full = s[:, 1] == args.max_num_batched_tokens  # all alike in size: what is left is the machine
    drift = full_step_drift(s[full])
    ms = lambda xs, q: percentile(list(xs), q) * 1e3 if len(xs) else float("nan")  # noqa: E731
    return {
        "pacing": pacing,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": ms(itl, 50), "itl_p95_ms": ms(itl, 95), "itl_p99_ms": ms(itl, 99),
        "itl_ratio": percentile(itl, 99) / percentile(itl, 50),
        "num_steps": len(s), "prefill_step_share": float(prefill.mean()),
        "decode_only_step_p50_ms": ms(s[~prefill, 0], 50), "decode_only_step_p99_ms": ms(s[~prefill, 0], 99),
        "prefill_step_p50_ms": ms(s[prefill, 0], 50), "prefill_step_p99_ms": ms(s[prefill, 0], 99),
        "full_step_share": float(full.mean()),
        "full_step_p50_ms": ms(s[full, 0], 50), "full_step_p99_ms": ms(s[full, 0], 99), **drift,
        "fit_ms": {"per_step": fit[0] * 1e3, "per_token": fit[1] * 1e3, "per_context_token_us": fit[2] * 1e6},
        "mean_decodes_per_step": float(s[:, 2].mean()), "mean_prefill_tokens_per_step": float(s[:, 4].mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pacing", type=lambda s: [int(x) for x in s.split(",")], default=[0, 64],
                   help="--prefill-pacing-steps values, run in turn (default: 0,64)")
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeat", type=int, default=1, help="cycle through --pacing this many times (default: 1)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([[1000 + i] * (16 + 100 * i) for i in range(4)], SamplingParams(max_tokens=8))  # warm up
    results = []
    for _ in range(args.repeat):
        for pacing in args.pacing:
            r = run(llm, pacing, args)
            results.append(r)
            f = r["fit_ms"]
            print(f"pacing {pacing:3d}: TTFT p50 {r['ttft_p50_s']:.2f}s p99 {r['ttft_p99_s']:.2f}s | ITL p50 "
                  f"{r['itl_p50_ms']:.1f} p95 {r['itl_p95_ms']:.1f} p99 {r['itl_p99_ms']:.1f} ms, p99/p50 "
                  f"{r['itl_ratio']:.2f} | {r['num_steps']} steps, {r['prefill_step_share']:.0%} with prompt tokens "
                  f"(p50 {r['prefill_step_p50_ms']:.1f} ms, p99 {r['prefill_step_p99_ms']:.1f}), decode-only p50 "
                  f"{r['decode_only_step_p50_ms']:.1f} ms p99 {r['decode_only_step_p99_ms']:.1f}, full-budget "
                  f"({r['full_step_share']:.0%}) p50 {r['full_step_p50_ms']:.1f} ms p99 {r['full_step_p99_ms']:.1f}, "
                  f"residual lag-1 autocorrelation {r['full_step_residual_lag1']:.2f}, medians of 50 "
                  f"{min(r['full_step_window_medians_ms'], default=float('nan')):.1f}-"
                  f"{max(r['full_step_window_medians_ms'], default=float('nan')):.1f} ms | fit: "
                  f"{f['per_step']:.1f} ms + {f['per_token']:.2f} ms/token + {f['per_context_token_us']:.1f} us/context "
                  f"token; {r['mean_decodes_per_step']:.1f} decodes, {r['mean_prefill_tokens_per_step']:.1f} prompt "
                  f"tokens per step", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
