"""The scheduler's link to the worker: ``Info`` and one long-lived ``Execute`` session, whose frame
link carries plans and results (``pagewire_common.framelink``), on the scheduler's asyncio event
loop, so plans and results never cross a thread."""

from __future__ import annotations

import grpc

from pagewire_common import step_profile, wire
from pagewire_common.framelink import CHANNEL_OPTIONS, LinkClosed, LinkSession
from pagewire_common.plan import StepPlan, StepResult
from pagewire_common.v1 import worker_pb2, worker_pb2_grpc


class WorkerLinkError(RuntimeError):
    """The worker is unreachable or ended the session."""


class WorkerLink:
    """Create inside the running event loop that will use it."""

    def __init__(self, address: str):
        self.address = address
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._session: LinkSession | None = None
        self._frame_link = None  # where the worker takes frame links, from its Info

    def _error(self, e: grpc.RpcError) -> WorkerLinkError:
        return WorkerLinkError(f"worker {self.address}: {e.code().name}: {e.details()}")

    async def info(self, timeout: float = 5.0) -> worker_pb2.InfoResponse:
        try:
            info = await self._stub.Info(worker_pb2.InfoRequest(), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as e:
            raise self._error(e) from None
        self._frame_link = info.frame_link
        return info

    async def open(self) -> None:
        """Start a fresh Execute session (the worker drops any state it had)."""
        self.close_stream()
        if self._frame_link is None:
            await self.info()
        try:
            self._session = await LinkSession.open(self.address, self._frame_link, self._stub.Execute)
        except LinkClosed as e:
            raise WorkerLinkError(f"worker {e}") from None

    async def send(self, plan: StepPlan) -> None:
        if self._session is None:
            raise WorkerLinkError("no session open with the worker")
        try:
            self._session.write(wire.plan_to_pb(plan).SerializeToString())
        except LinkClosed as e:
            raise WorkerLinkError(f"worker {e}") from None

    async def receive(self) -> StepResult:
        if self._session is None:
            raise WorkerLinkError("no session open with the worker")
        try:
            with step_profile.phase("wait for result"):
                data = await self._session.read()
        except LinkClosed as e:
            raise WorkerLinkError(f"worker {e}") from None
        with step_profile.phase("result decode"):
            return wire.result_from_pb(worker_pb2.StepResult.FromString(data))

    def on_lost(self, callback) -> None:
        """Call ``callback()`` when the open session ends (the worker went away): the core, idle,
        reads nothing that would tell it."""
        if self._session is not None:
            self._session.ended.add_done_callback(lambda _: callback())

    def lost(self) -> str | None:
        """Why the open session ended, or None while it runs."""
        session = self._session
        return f"worker {self.address}: {session.reason}" if session is not None and session.ended.done() else None

    def close_stream(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    async def close(self) -> None:
        self.close_stream()
        await self._channel.close()
