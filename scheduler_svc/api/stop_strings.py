"""Stop strings found in time independent of their number: a lazily built Aho–Corasick automaton.

A request's stop strings become one ``StopStrings`` (built once per request, shared by its
samples); each stream walks it with a ``StopMatcher``, one step per decoded character. The
matcher's state is the longest suffix of the text so far that is a prefix of some stop string:
its length is how much text must be held back, and a state that ends with a whole stop string is
a match. A step is a dict lookup once the transition is known, so feeding costs the same for one
stop string as for ``MAX_STOP_STRINGS`` of them.

The automaton is built as the text walks it, not up front: the strings are sorted once, a trie
node is a range of them that shares a prefix (``_lo``, ``_hi``, ``_depth``), made the first time
the text reaches it, with its failure link, and each (state, character) transition is kept once
found. The build is a sort (well under a millisecond for the largest allowed set), so a request
with many stop strings never stalls the API server's event loop, and a node costs work only if
the text ever gets there.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable


class StopStrings:
    """The automaton over one request's stop strings. Node 0 is the root (the empty prefix);
    nodes live in flat lists indexed by node id."""

    __slots__ = ("_strings", "_lo", "_hi", "_depth", "_fail", "_out", "_next")

    def __init__(self, stops: Iterable[str]):
        strings = sorted(set(stops))
        if not strings or not all(strings):
            raise ValueError("stop strings must be non-empty and at least one must be given")
        self._strings = strings
        # node -> the strings with its prefix are _strings[_lo:_hi]; the prefix is _depth long
        self._lo = [0]
        self._hi = [len(strings)]
        self._depth = [0]
        self._fail = [0]  # node -> the node of its longest proper suffix that is a trie node
        self._out = [0]  # node -> length of the longest stop string its prefix ends with (0: none)
        self._next: list[dict[str, int]] = [{}]  # node -> the transitions found so far

    def _child_range(self, node: int, ch: str) -> tuple[int, int] | None:
        """The strings under ``node`` whose next character is ``ch``, or None if there are none."""
        depth, lo, hi = self._depth[node], self._lo[node], self._hi[node]
        if hi - lo == 1:  # deep in the trie most nodes are one string's
            return (lo, hi) if self._strings[lo][depth:depth + 1] == ch else None

        def key(s: str) -> str:
            return s[depth:depth + 1]  # "" for the string that ends here, which sorts first

        lo = bisect_left(self._strings, ch, lo, hi, key=key)
        hi = bisect_right(self._strings, ch, lo, hi, key=key)
        return (lo, hi) if lo < hi else None

    def _transition(self, node: int, ch: str) -> int:
        """The state after ``node`` reads ``ch``, making the trie nodes this needs. Iterative: a
        new child's failure link is the transition of its parent's failure link, so the chain is
        walked down to a node whose transition is known and the answers are made on the way up."""
        next_, fail = self._next, self._fail
        chain: list[tuple[int, tuple[int, int] | None]] = []
        while True:
            known = next_[node].get(ch)
            if known is not None:
                target = known
                break
            chain.append((node, self._child_range(node, ch)))
            if node == 0:
                target = 0  # the root without a child on ch stays at the root
                break
            node = fail[node]
        for node, child in reversed(chain):
            if child is not None:  # a new trie node; `target` is the transition of its parent's failure link
                target = self._new_node(child, self._depth[node] + 1, target)
            next_[node][ch] = target
        return target

    def _new_node(self, strings: tuple[int, int], depth: int, fail: int) -> int:
        lo, hi = strings
        node = len(self._lo)
        self._lo.append(lo)
        self._hi.append(hi)
        self._depth.append(depth)
        self._fail.append(fail)
        # the shortest string of the range sorts first: it is a whole stop string iff it is `depth` long
        self._out.append(depth if len(self._strings[lo]) == depth else self._out[fail])
        self._next.append({})
        return node

    @property
    def num_nodes(self) -> int:
        """Trie nodes made so far (for tests and measurements)."""
        return len(self._lo)


class StopMatcher:
    """One stream's walk through a ``StopStrings`` automaton."""

    __slots__ = ("stops", "state", "num_chars", "match_length")

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.state = 0
        self.num_chars = 0  # characters fed so far
        self.match_length = 0  # the length of the stop string the last hit ``feed`` returned

    @property
    def num_held(self) -> int:
        """Length of the longest suffix of the text fed that is a prefix of some stop string: text
        that could still become a stop string and must not be streamed yet."""
        return self.stops._depth[self.state]

    def feed(self, text: str) -> int | None:
        """Read ``text``, the characters decoded since the last call. Returns where (an offset in
        all the text fed) the stop string that ends in ``text`` and starts first begins, or None;
        that string's length is then ``match_length``.

        Of several stop strings completed by one call the earliest-starting wins, even one that
        ends after another: with stops "abcd" and "bc", "abcd" in one call cuts before "a", while
        "abc" then "d" cuts at "bc". (This is what searching the new text for each string and
        taking the smallest position gave.)"""
        automaton = self.stops
        next_, out = automaton._next, automaton._out
        state = self.state
        end = self.num_chars
        first = None
        for ch in text:
            end += 1
            target = next_[state].get(ch)
            state = automaton._transition(state, ch) if target is None else target
            length = out[state]  # the longest stop string ending here starts earliest
            if length and (first is None or end - length < first):
                first = end - length
                self.match_length = length
        self.state = state
        self.num_chars = end
        return first
