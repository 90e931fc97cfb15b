"""The clients' names of the requests running in the core: the public ``request_id`` strings, each
unique among running requests whichever API server took them, and the public ``Abort``'s way in.

A name maps to the request's one id (the first sample's; its API server is in the high bits), so
no second id travels: the name only finds the id. An entry lives while any of its samples is in
flight in the core (``is_running``: in its API server's ``request_ids``, the set every exit path
updates: finish, stop, abort, a lost worker, a departed API server). Ended entries are dropped
when their name is looked up, and swept once the map has doubled since the last sweep, so the
map stays within twice the running requests (and at least ``MIN_SWEEP``) at O(1) per add.
"""

from __future__ import annotations

from typing import Callable

MIN_SWEEP = 1024  # entries below which no sweep runs


class RequestNames:
    def __init__(self, is_running: Callable[[int], bool]):
        self._is_running = is_running  # request id (one sample's) -> still in flight in the core
        self._ids: dict[str, range] = {}  # name -> the request's ids, one per sample
        self._sweep_at = MIN_SWEEP

    def __len__(self) -> int:
        return len(self._ids)

    def running(self, name: str) -> range | None:
        """The ids of the request running under ``name`` (one per sample), or None."""
        ids = self._ids.get(name)
        if ids is None:
            return None
        if not self._any_running(ids):
            del self._ids[name]
            return None
        return ids

    def add(self, name: str, request_id: int, n: int) -> None:
        """Name the request of ids ``request_id .. request_id + n - 1`` (``running(name)`` was None)."""
        self._ids[name] = range(request_id, request_id + n)
        if len(self._ids) >= self._sweep_at:
            self._ids = {k: ids for k, ids in self._ids.items() if self._any_running(ids)}
            self._sweep_at = max(MIN_SWEEP, 2 * len(self._ids))

    def remove(self, name: str) -> None:
        self._ids.pop(name, None)

    def _any_running(self, ids: range) -> bool:
        return any(self._is_running(i) for i in ids)
