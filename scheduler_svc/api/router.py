"""Which engine core takes a request (``--data-parallel-size``, ``--data-parallel-cores``).

Every API server keeps one ``Router``. Its index maps a prefix-cache block hash to the cores that
hold it, fed by each core's KV events (``BlockStored`` adds, ``BlockRemoved`` removes,
``AllBlocksCleared`` and a lost core drop all of that core's entries) and by the router's own
choices: a routed prompt's block hashes are entered for its core at once, so the next requests with
the same prefix follow it before the core has computed and announced the blocks (a claim the core
never confirms stays until the core evicts that hash or clears).

The rules, over the cores that are up (``loads[i]`` is None for a core that is not):

- ``cache-aware``: the core holding the longest run of the prompt's leading block hashes (ties: the
  least loaded, then the lowest index), unless its load exceeds the least loaded core's by more
  than ``balance_threshold`` requests; then the least loaded core.
- ``least-loaded``: the least loaded core (ties: in turn).
- ``round-robin``: the next core in turn.

A core's load is its running plus waiting requests as this API server counts them
(``CoreLink.load``). The API server leaves out the cores with no room for a request (over
``max_num_seqs`` plus their queue) while another has room (``ApiServer.route``). Pure Python, no I/O: ``tests/test_router.py`` holds the rules.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagewire_common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from pagewire_common.settings import ROUTINGS, default_of


class NoCoreError(RuntimeError):
    """No engine core is up to take a request."""


class Router:
    def __init__(self, num_cores: int, routing: str = default_of("data_parallel_routing"),
                 balance_threshold: int = default_of("data_parallel_balance_threshold")):
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; one of {', '.join(ROUTINGS)}")
        if num_cores < 1:
            raise ValueError(f"a router needs at least one core, got {num_cores}")
        self.num_cores = num_cores
        self.routing = routing
        self.balance_threshold = balance_threshold
        self._cores_of: dict[int, set[int]] = {}  # block hash -> the cores that hold it
        self._hashes_of: list[set[int]] = [set() for _ in range(num_cores)]  # core -> its hashes
        self._turn = 0

    @property
    def uses_kv_events(self) -> bool:
        return self.routing == "cache-aware" and self.num_cores > 1

    # ---- the index -----------------------------------------------------------------------------

    def apply_events(self, core: int, events: Iterable[KVEvent]) -> None:
        """One batch of ``core``'s KV events, oldest first."""
        for event in events:
            if isinstance(event, BlockStored):
                self._add(core, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    self._remove(core, block_hash)
            elif isinstance(event, AllBlocksCleared):
                self.clear(core)

    def clear(self, core: int) -> None:
        """``core`` holds nothing (it cleared its cache, or it is gone)."""
        for block_hash in self._hashes_of[core]:
            cores = self._cores_of.get(block_hash)
            if cores is not None:
                cores.discard(core)
                if not cores:
                    del self._cores_of[block_hash]
        self._hashes_of[core] = set()

    def num_indexed(self, core: int) -> int:
        return len(self._hashes_of[core])

    def _add(self, core: int, block_hashes: Iterable[int]) -> None:
        mine = self._hashes_of[core]
        for block_hash in block_hashes:
            if block_hash not in mine:
                mine.add(block_hash)
                self._cores_of.setdefault(block_hash, set()).add(core)

    def _remove(self, core: int, block_hash: int) -> None:
        self._hashes_of[core].discard(block_hash)
        cores = self._cores_of.get(block_hash)
        if cores is not None:
            cores.discard(core)
            if not cores:
                del self._cores_of[block_hash]

    def matched_blocks(self, core: int, block_hashes: Sequence[int]) -> int:
        """How many of the leading ``block_hashes`` ``core`` holds, in a row."""
        mine = self._hashes_of[core]
        n = 0
        for block_hash in block_hashes:
            if block_hash not in mine:
                break
            n += 1
        return n

    # ---- the choice ----------------------------------------------------------------------------

    def pick(self, block_hashes: Sequence[int], loads: Sequence[int | None]) -> int:
        """The core for a prompt whose full blocks hash to ``block_hashes``; ``loads[i]`` is core
        i's load, None while it is down. ``NoCoreError`` when every core is down. The prompt's
        hashes are entered for the chosen core (cache-aware routing)."""
        up = [i for i, load in enumerate(loads) if load is not None]
        if not up:
            raise NoCoreError("no engine core is connected")
        if self.routing == "round-robin":
            core = self._next_in_turn(up)
        elif self.routing == "least-loaded" or not self.uses_kv_events:
            core = self._least_loaded(up, loads)
        else:
            core = self._cache_aware(up, block_hashes, loads)
            self._add(core, block_hashes)
        return core

    def _next_in_turn(self, up: list[int]) -> int:
        n = self.num_cores
        core = min(up, key=lambda i: (i - self._turn) % n)
        self._turn = (core + 1) % n
        return core

    def _least_loaded(self, up: list[int], loads: Sequence[int | None]) -> int:
        # ties in turn, so that equal loads do not all go to the first core
        n = self.num_cores
        core = min(up, key=lambda i: (loads[i], (i - self._turn) % n))
        self._turn = (core + 1) % n
        return core

    def _cache_aware(self, up: list[int], block_hashes: Sequence[int], loads: Sequence[int | None]) -> int:
        least = self._least_loaded(up, loads)
        matched = {i: self.matched_blocks(i, block_hashes) for i in up}
        best = max(up, key=lambda i: (matched[i], -loads[i], -i))
        if matched[best] == 0 or loads[best] - loads[least] > self.balance_threshold:
            return least
        return best
