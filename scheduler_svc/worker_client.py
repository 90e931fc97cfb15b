"""The scheduler's link to the worker: ``Info`` and one long-lived ``Execute`` stream."""

from __future__ import annotations

import queue

import grpc

from pagewire import wire
from pagewire.plan import StepPlan, StepResult
from pagewire.v1 import worker_pb2, worker_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a worker that stops answering (not just one that closes its socket) is noticed in seconds
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # reconnect quickly when a restarted worker comes back
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WorkerLinkError(RuntimeError):
    """The worker is unreachable or broke the stream."""


class WorkerLink:
    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._plans: queue.SimpleQueue | None = None
        self._results = None
        self._call = None

    def info(self, timeout: float = 5.0) -> worker_pb2.InfoResponse:
        try:
            return self._stub.Info(worker_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise WorkerLinkError(f"worker {self.address}: {e.code().name}: {e.details()}") from None

    def open(self) -> None:
        """Start a fresh Execute stream (the worker drops any state it had)."""
        self.close_stream()
        plans: queue.SimpleQueue = queue.SimpleQueue()
        self._plans = plans
        self._call = self._stub.Execute(iter(plans.get, None))
        self._results = self._call

    def send(self, plan: StepPlan) -> None:
        if self._plans is None:
            raise WorkerLinkError("no stream open to the worker")
        self._plans.put(wire.plan_to_pb(plan))

    def receive(self) -> StepResult:
        try:
            return wire.result_from_pb(next(self._results))
        except StopIteration:
            raise WorkerLinkError(f"worker {self.address} closed the stream") from None
        except grpc.RpcError as e:
            raise WorkerLinkError(f"worker {self.address}: {e.code().name}: {e.details()}") from None

    def execute(self, plan: StepPlan) -> StepResult:
        self.send(plan)
        return self.receive()

    def close_stream(self) -> None:
        if self._plans is not None:
            self._plans.put(None)
            self._plans = None
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._results = None

    def close(self) -> None:
        self.close_stream()
        self._channel.close()
