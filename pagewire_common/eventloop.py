"""The event loop the scheduler and worker services run on.

Both services are grpc.aio processes whose loops hand off thousands of small callbacks a second
(a streamed message, a worker round trip, an accepted call). uvloop runs the same asyncio
programs with the loop's bookkeeping in C; with 256 streams on the null worker the scheduler
spent about 4% less CPU per token than on the standard loop (docs/benchmarks.md, section 3).
``PAGEWIRE_EVENT_LOOP`` picks: ``auto`` (uvloop when it is installed, else asyncio's own),
``uvloop`` (required) or ``asyncio``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from pagewire_common import envs

log = logging.getLogger("pagewire")

T = TypeVar("T")
CHOICES = ("auto", "uvloop", "asyncio")


def loop_factory() -> tuple[str, Callable[[], asyncio.AbstractEventLoop] | None]:
    """(name, factory) of the loop to use; a None factory means asyncio's default."""
    choice = envs.event_loop()
    if choice not in CHOICES:
        raise ValueError(f"PAGEWIRE_EVENT_LOOP={choice!r}: choose one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio", None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise RuntimeError("PAGEWIRE_EVENT_LOOP=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return "asyncio", None
    return f"uvloop {uvloop.__version__}", uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop."""
    try:
        name, factory = loop_factory()
    except (ValueError, RuntimeError):
        main.close()  # never awaited: do not leave a "coroutine was never awaited" warning
        raise
    log.debug("event loop: %s", name)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


class Outbox:
    """Messages for one consumer on the same loop: the producer appends without waiting, the
    consumer takes everything that piled up at once."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def take(self) -> list:
        """Wait for at least one item; return all that are there, oldest first."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items
