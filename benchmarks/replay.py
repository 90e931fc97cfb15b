"""Section 2's workload driven through an ``EngineCore`` on a clock: shared by step_trace.py
(the wall clock and the real model) and pacing_sim.py (a simulated clock and a step-cost model).

Requests arrive as Poisson arrivals; the engine steps without overlap, and every token is timed
when its step ends. TTFT is arrival to first token and ITL every gap between a stream's tokens,
pooled, as `pagewire bench` measures them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.sampling import SamplingParams
from scheduler_svc.engine import EngineCore


class Clock(Protocol):
    def now(self) -> float: ...

    def idle_until(self, t: float) -> None: ...

    def execute(self, plan: StepPlan) -> tuple[StepResult, float, Any]:
        """Run a step: (its result, the time it ended, what to record about it)."""


@dataclass
class Replay:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    steps: list = field(default_factory=list)  # what the clock recorded for each step


def poisson_arrivals(seed: int, num_requests: int, rate: float, prompt_len: tuple[int, int],
                     token_range: tuple[int, int]) -> list[tuple[float, list[int]]]:
    """(arrival time, prompt) pairs: exponential gaps at ``rate`` per second, prompt lengths
    uniform in ``prompt_len`` and token ids uniform in ``token_range`` (both inclusive-exclusive
    as ``randint`` and ``randrange`` take them)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append((t, [rng.randrange(*token_range) for _ in range(rng.randint(*prompt_len))]))
    return arrivals


def replay(engine: EngineCore, arrivals: list[tuple[float, list[int]]], sampling: SamplingParams,
           clock: Clock) -> Replay:
    out = Replay()
    sent: dict[str, float] = {}
    last: dict[str, float] = {}
    nxt = 0
    while nxt < len(arrivals) or engine.has_unfinished():
        now = clock.now()
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            rid = f"r{nxt}"
            engine.add_request(rid, prompt_token_ids=arrivals[nxt][1], sampling=sampling)
            sent[rid] = arrivals[nxt][0]
            nxt += 1
        plan = engine.schedule()
        if plan is None:
            if nxt < len(arrivals):
                clock.idle_until(arrivals[nxt][0])
            continue
        result, done, record = clock.execute(plan)
        out.steps.append(record)
        for delta in engine.outputs(engine.process_result(result)):
            rid = delta.request_id
            for _ in delta.token_ids:
                if rid in last:
                    out.itl.append(done - last[rid])
                else:
                    out.ttft.append(done - sent[rid])
                last[rid] = done
    return out
