"""The scheduler core's own CPU per token, without a transport. Feeds docs/benchmarks.md,
section "The core's own cost".

    python benchmarks/core_cpu.py [--streams 256] [--max-new-tokens 64] [--num-requests 2048] [--prompt-len 16]
        [--worker-step-ms 0,3]

Runs ``CoreService`` (the engine task, admission, the allocator, per-step messages to an API
server) on one event loop against an in-process worker that answers every plan at once, and one
in-process API-server stream that takes each step's message and acknowledges it. Plans and results
still go through their protobuf encoding both ways, as over gRPC; the worker's and the API
server's sides of that are timed apart and left out. What remains is the core's Python work per token at full batches: the
floor under what the served core spends, which adds grpc.aio's per-message costs.

``--worker-step-ms 0,3`` runs each repeat once per value, in turn: the worker answers each plan after
that many milliseconds of idle wait (a served worker's step time), so the core's event loop sleeps
before every result as a served core does, and the figures show what that idling costs the same
work on this host (code runs slower after an idle wait; ``burst_cpu.py`` measures that alone).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from types import SimpleNamespace

from pagewire_common import eventloop, wire
from pagewire_common.core_messages import CoreOutputs, CoreRequests, NewRequest, first_request_id
from pagewire_common.eventloop import Outbox
from pagewire_common.plan import StepResult
from pagewire_common.sampling import SamplingParams
from pagewire_common.settings import Settings
from scheduler_svc.core.service import CoreService


class InstantWorker:
    """The WorkerLink interface, answering each plan at once with one token per sequence that
    reached the end of its known tokens; its own CPU time (both wire ends) is counted apart."""

    def __init__(self, address: str, step_s: float = 0.0):
        self.step_s = step_s  # idle wait before each result (a served worker's step time)
        self.known: dict[int, int] = {}
        self.computed: dict[int, int] = {}
        self.results: list[StepResult] = []
        self.cpu_s = 0.0

    async def info(self, timeout: float = 5.0):
        return SimpleNamespace(model_name="instant", vocab_size=50_000, max_model_len=4096, block_size=16,
                               num_kv_blocks=1 << 16, eos_token_ids=[0], dtype="float32", device="cpu",
                               tokenizer_files={}, structured_output=False)

    async def open(self) -> None:
        pass

    async def send(self, plan) -> None:
        msg = wire.plan_to_pb(plan)  # the core's encode: counted with the core
        t1 = time.process_time()
        plan = wire.plan_from_pb(msg)
        for seq_id in plan.finished_seq_ids:
            self.known.pop(seq_id, None)
            self.computed.pop(seq_id, None)
        for s in plan.new_seqs:
            self.known[s.seq_id] = len(s.token_ids)
            self.computed[s.seq_id] = s.num_computed_tokens
        seq_ids, tokens = [], []
        for s in [*plan.new_seqs, *plan.running_seqs]:
            done = self.computed[s.seq_id] + s.num_scheduled_tokens
            self.computed[s.seq_id] = done
            if done == self.known[s.seq_id]:
                self.known[s.seq_id] += 1
                seq_ids.append(s.seq_id)
                tokens.append(7)
        encoded = wire.result_to_pb(StepResult(plan.step_id, seq_ids, tokens))
        self.cpu_s += time.process_time() - t1
        self.results.append(wire.result_from_pb(encoded))  # the core's decode: counted with the core

    async def receive(self):
        await asyncio.sleep(self.step_s)
        return self.results.pop(0)

    def on_lost(self, callback) -> None:
        pass  # never lost

    def lost(self) -> None:
        return None

    def close_stream(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def run(args, step_s: float = 0.0) -> tuple[float, float, int]:
    workers: list[InstantWorker] = []
    service = CoreService("in-process", Settings(max_num_seqs=args.streams),
                          link_factory=lambda address: workers.append(InstantWorker(address, step_s)) or workers[-1])
    service.start()
    await service.connected.wait()
    # the messages cross as bytes both ways, as on a Connect session (the packing is the core's cost)
    inbox = Outbox()
    client = service.open_client(send=lambda outputs: inbox.put_nowait(outputs.to_bytes()))
    sampling = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=True)
    # a prompt per request, none sharing a block with another (no prefix-cache hits), as in a bench
    base = list(range(1, args.prompt_len + 1))
    first_id = first_request_id(client.api_server_id)
    finished = 0
    acked = 0
    api_cpu = 0.0  # the API server's side of the wire (its encoding and decoding), left out

    def apply(requests: CoreRequests) -> None:
        nonlocal api_cpu
        t1 = time.process_time()
        data = requests.to_bytes()
        api_cpu += time.process_time() - t1
        service.apply(client, CoreRequests.from_bytes(data))

    async def api_server() -> None:
        nonlocal finished, acked, api_cpu
        while finished < args.num_requests:
            for data in await inbox.take():
                t1 = time.process_time()
                msg = CoreOutputs.from_bytes(data)
                api_cpu += time.process_time() - t1
                finished += len(msg.finished_ids)
                if msg.finished_ids:
                    room.set()
                if msg.has_tokens:
                    acked += 1
                    apply(CoreRequests(num_outputs_done=acked))

    room = asyncio.Event()  # set when a request finished: the feeder below sends more
    consumer = asyncio.ensure_future(api_server())
    t0 = time.process_time()
    sent = 0
    while sent < args.num_requests:
        while sent - finished < args.streams and sent < args.num_requests:
            apply(CoreRequests(adds=[NewRequest(first_id + sent, [1000 + sent, *base[1:]], sampling)]))
            sent += 1
        room.clear()
        await room.wait()
    await consumer
    total = time.process_time() - t0
    steps = service.num_steps
    await service.stop()
    return total, workers[0].cpu_s + api_cpu, steps


def step_list(text: str) -> list[float]:
    """``--worker-step-ms``: comma-separated milliseconds, each >= 0."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {text!r}") from None
    if not values or any(not 0 <= v < 1000 for v in values):
        raise argparse.ArgumentTypeError(f"each value must be in [0, 1000) ms, got {text!r}")
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=16, help="tokens per prompt, each prompt its own")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--worker-step-ms", type=step_list, default=[0.0], metavar="MS[,MS...]",
                   help="the in-process worker answers each plan after this idle wait; several values are run in "
                        "turn within each repeat (default: 0, at once)")
    args = p.parse_args()
    tokens = args.num_requests * args.max_new_tokens
    for _ in range(args.repeat):
        for step_ms in args.worker_step_ms:
            total, others, steps = eventloop.run(run(args, step_ms / 1e3))
            wait = f"worker step {step_ms:g} ms: " if len(args.worker_step_ms) > 1 or step_ms else ""
            print(f"{wait}core CPU {1e6 * (total - others) / tokens:.2f} us/token ({tokens / steps:.0f} tokens/step); "
                  f"the in-process worker's and API server's sides of the wire {1e6 * others / tokens:.2f} "
                  f"us/token, left out", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
