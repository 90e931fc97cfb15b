"""The scheduler's link to the worker: ``Info`` and one long-lived ``Execute`` stream, on the
scheduler's asyncio event loop (grpc.aio), so plans and results never cross a thread."""

from __future__ import annotations

import grpc

from pagewire_common import wire
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.v1 import worker_pb2, worker_pb2_grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# the options of both internal links (core -> worker, API server -> core)
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a peer that stops answering (not just one that closes its socket) is noticed in seconds
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 3000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # reconnect quickly when a restarted peer comes back
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class WorkerLinkError(RuntimeError):
    """The worker is unreachable or broke the stream."""


class WorkerLink:
    """Create inside the running event loop that will use it."""

    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._call = None

    def _error(self, e: grpc.RpcError) -> WorkerLinkError:
        return WorkerLinkError(f"worker {self.address}: {e.code().name}: {e.details()}")

    async def info(self, timeout: float = 5.0) -> worker_pb2.InfoResponse:
        try:
            return await self._stub.Info(worker_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise self._error(e) from None

    def open(self) -> None:
        """Start a fresh Execute stream (the worker drops any state it had)."""
        self.close_stream()
        self._call = self._stub.Execute()

    async def send(self, plan: StepPlan) -> None:
        if self._call is None:
            raise WorkerLinkError("no stream open to the worker")
        try:
            await self._call.write(wire.plan_to_pb(plan))
        except grpc.RpcError as e:
            raise self._error(e) from None
        except (grpc.aio.UsageError, RuntimeError) as e:  # the stream already ended
            raise WorkerLinkError(f"worker {self.address}: stream closed ({e})") from None

    async def receive(self) -> StepResult:
        if self._call is None:
            raise WorkerLinkError("no stream open to the worker")
        try:
            msg = await self._call.read()
        except grpc.RpcError as e:
            raise self._error(e) from None
        if msg is grpc.aio.EOF:
            raise WorkerLinkError(f"worker {self.address} closed the stream")
        return wire.result_from_pb(msg)

    def close_stream(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self.close_stream()
        await self._channel.close()
