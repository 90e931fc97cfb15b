"""Prefill pacing on a simulated clock: the real scheduler, a worker whose steps cost time by a
linear model, and section 2's workload (Poisson arrivals, prompts of 16-512 tokens).

    python benchmarks/pacing_sim.py [--rates 1.0,1.5,1.8] [--budgets 32,512] [--pacing 0,32,64]
        [--step-ms 20] [--token-ms 0.9] [--noise 0.05]

Each step takes ``step_ms + token_ms * scheduled tokens``, times a lognormal noise factor: the
defaults are the least-squares fit `benchmarks/step_trace.py` gave for SmolLM2-135M in fp32 on
this 2-core VM (26.8 ms + 1.02 ms per token; the context term was ~2 us per token, left out). The scheduler, allocator and engine are the
project's own (EngineCore over the torch-free FakeKVWorker); only the clock is simulated, so the
figures show what the policy does without the VM's noise. TTFT is arrival to first token; ITL is
every gap between a stream's tokens, pooled, as `pagewire bench` measures them.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagewire.bench.metrics import percentile  # noqa: E402
from pagewire.sampling import SamplingParams  # noqa: E402
from scheduler_svc.config import SchedulerConfig  # noqa: E402
from scheduler_svc.engine import EngineCore, WorkerInfo  # noqa: E402
from tests.fake_worker import EOS, VOCAB, FakeKVWorker  # noqa: E402


def simulate(rate: float, budget: int, pacing: int, args) -> dict:
    rng = random.Random(args.seed)
    noise = random.Random(args.seed + 1)
    blocks = 4096
    worker = FakeKVWorker(blocks, 16)
    info = WorkerInfo("sim", VOCAB, 2048, 16, blocks, (EOS,))
    config = SchedulerConfig(max_model_len=2048, max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
                             prefill_pacing_steps=pacing)
    engine = EngineCore(config, info, worker)
    arrivals, t = [], 0.0
    for _ in range(args.num_requests):
        t += rng.expovariate(rate)
        arrivals.append((t, [rng.randrange(VOCAB - 1) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]))
    sampling = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    now, nxt, sent, last, ttft, itl, steps = 0.0, 0, {}, {}, [], [], []
    while nxt < len(arrivals) or engine.has_unfinished():
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            engine.add_request(f"r{nxt}", prompt_token_ids=arrivals[nxt][1], sampling=sampling)
            sent[f"r{nxt}"] = arrivals[nxt][0]
            nxt += 1
        plan = engine.schedule()
        if plan is None:
            now = arrivals[nxt][0]  # idle until the next arrival
            continue
        result = worker.execute(plan)
        now += (args.step_ms + args.token_ms * plan.num_scheduled_tokens) / 1e3 * noise.lognormvariate(0, args.noise)
        steps.append(plan.num_scheduled_tokens)
        for out in engine.process_result(result):
            for _ in out.token_ids:
                rid = out.request_id
                if rid in last:
                    itl.append(now - last[rid])
                else:
                    ttft.append(now - sent[rid])
                last[rid] = now
    engine.allocator.check_integrity()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    return {
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "ratio": percentile(itl, 99) / percentile(itl, 50),
        "full_steps": sum(n >= budget - 1 for n in steps) / len(steps), "served_req_s": len(arrivals) / now,
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
