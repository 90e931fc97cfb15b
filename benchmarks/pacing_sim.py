"""Prefill pacing on a simulated clock: the real scheduler, a worker whose steps cost time by a
linear model, and section 2's workload (Poisson arrivals, prompts of 16-512 tokens).

    python benchmarks/pacing_sim.py [--rates 1.0,1.5,1.8] [--budgets 32,512] [--pacing 0,32,64]
        [--step-ms 27] [--token-ms 1.0] [--noise 0.05]

Each step takes ``step_ms + token_ms * scheduled tokens``, times a lognormal noise factor: the
defaults are the least-squares fit `benchmarks/step_trace.py` gave for SmolLM2-135M in fp32 on
this 2-core VM (26.8 ms + 1.02 ms per token; the context term was ~2 us per token, left out).
The scheduler, allocator and engine are the project's own (EngineCore over the torch-free FakeKVWorker, driven by benchmarks/replay.py);
only the clock is simulated, so the figures show what the policy does without the VM's noise.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.replay import poisson_arrivals, replay  # noqa: E402
from pagewire.bench.metrics import percentile  # noqa: E402
from pagewire_common.sampling import SamplingParams  # noqa: E402
from scheduler_svc.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine import EngineCore, WorkerInfo  # noqa: E402
from tests.fake_worker import EOS, VOCAB, FakeKVWorker  # noqa: E402


class SimClock:
    """Steps take ``step_ms + token_ms * scheduled tokens``, times a lognormal noise factor."""

    def __init__(self, worker: FakeKVWorker, args):
        self.worker = worker
        self.args = args
        self.noise = random.Random(args.seed + 1)
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def idle_until(self, t: float) -> None:
        self.t = t

    def execute(self, plan):
        a = self.args
        result = self.worker.execute(plan)
        self.t += (a.step_ms + a.token_ms * plan.num_scheduled_tokens) / 1e3 * self.noise.lognormvariate(0, a.noise)
        return result, self.t, plan.num_scheduled_tokens


def simulate(rate: float, budget: int, pacing: int, args) -> dict:
    blocks = 4096
    worker = FakeKVWorker(blocks, 16)
    info = WorkerInfo("sim", VOCAB, 2048, 16, blocks, (EOS,))
    config = SchedulerConfig(max_model_len=2048, max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
                             prefill_pacing_steps=pacing)
    engine = EngineCore(config, info, worker)
    arrivals = poisson_arrivals(args.seed, args.num_requests, rate, (args.min_prompt, args.max_prompt), (0, VOCAB - 1))
    sampling = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    clock = SimClock(worker, args)
    r = replay(engine, arrivals, sampling, clock)
    engine.allocator.check_integrity()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    ttft, itl = r.ttft, r.itl
    return {
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "ratio": percentile(itl, 99) / percentile(itl, 50),
        "full_steps": sum(n >= budget - 1 for n in r.steps) / len(r.steps), "served_req_s": len(arrivals) / clock.t,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.5, 1.8],
                   help="Poisson arrival rates, req/s (default: 1.0,1.5,1.8)")
    p.add_argument("--budgets", type=ints, default=[32, 512], help="--max-num-batched-tokens values (default: 32,512)")
    p.add_argument("--pacing", type=ints, default=[0, 32, 64], help="--prefill-pacing-steps values (default: 0,32,64)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=27.0, help="fixed cost of a step (default: %(default)s)")
    p.add_argument("--token-ms", type=float, default=1.0, help="cost per scheduled token (default: %(default)s)")
    p.add_argument("--noise", type=float, default=0.05, help="sigma of the lognormal step-time factor (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    print(f"{'rate':>5} {'budget':>6} {'pacing':>6} | {'TTFT p50':>8} {'TTFT p99':>8} | {'ITL p50':>7} {'ITL p99':>7} "
          f"{'p99/p50':>7} | {'full':>5} {'served':>6}")
    for rate in args.rates:
        for budget in args.budgets:
            for pacing in args.pacing:
                r = simulate(rate, budget, pacing, args)
                print(f"{rate:5.2f} {budget:6d} {pacing:6d} | {r['ttft_p50_s']:7.2f}s {r['ttft_p99_s']:7.2f}s | "
                      f"{r['itl_p50_ms']:5.1f}ms {r['itl_p99_ms']:5.1f}ms {r['ratio']:7.2f} | "
                      f"{r['full_steps']:5.2f} {r['served_req_s']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
