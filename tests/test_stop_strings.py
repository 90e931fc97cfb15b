"""Stop strings: the automaton against the brute-force search it replaced, the semantics it keeps
(where text is cut, what is held back), and the limits on a request's stop strings."""

from __future__ import annotations

import random

import pytest

from pagewire_common.sampling import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from scheduler_svc.api.stop_strings import StopMatcher, StopStrings
from scheduler_svc.api.tokenizer import IncrementalDetokenizer


class BruteForceStops:
    """The search the automaton replaced: every stop string looked for in the new text, the
    earliest match cut, and the longest tail that is a proper prefix of a stop string held back."""

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        self.stops = stops
        self.include = include  # include_stop_str_in_output: the text ends with the stop string
        self.text = ""
        self.num_emitted_chars = 0
        self.stopped = False

    def update(self, chunk: str, is_final: bool) -> str:
        if self.stopped:
            return ""
        self.text += chunk
        emit_upto = len(self.text)
        start = max(self.num_emitted_chars - max(len(s) for s in self.stops), 0)
        hit = min((p for p in (self.text.find(s, start) for s in self.stops) if p >= 0), default=-1)
        if hit >= 0:
            self.stopped = True
            if self.include:  # of the strings that start there, the shortest ends first
                hit += min(len(s) for s in self.stops if self.text.find(s, start) == hit)
            self.text = self.text[:hit]
            emit_upto = hit
        elif not is_final:
            emit_upto = len(self.text) - longest_stop_prefix_suffix(self.text, self.stops)
        emit_upto = max(emit_upto, self.num_emitted_chars)
        delta = self.text[self.num_emitted_chars:emit_upto]
        self.num_emitted_chars = emit_upto
        return delta


def longest_stop_prefix_suffix(text: str, stops) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0)


class ChunkTokenizer:
    """A byte-level 'tokenizer' whose token i is the i-th chunk of a text given in advance."""

    def __init__(self, chunks: list[str]):
        self.token_bytes = [c.encode() for c in chunks]


def detokenize(chunks: list[str], stops: tuple[str, ...], is_final: bool = True,
               include: bool = False) -> tuple[list[str], IncrementalDetokenizer]:
    """Each chunk fed as one token; the deltas and the detokenizer."""
    detok = IncrementalDetokenizer.for_prompt(ChunkTokenizer(chunks), 0, stops, include_stop=include)
    deltas = [detok.update(list(range(i + 1)), is_final=is_final and i == len(chunks) - 1) for i in range(len(chunks))]
    return deltas, detok


def brute_force(chunks: list[str], stops: tuple[str, ...], is_final: bool = True,
                include: bool = False) -> tuple[list[str], BruteForceStops]:
    ref = BruteForceStops(stops, include)
    deltas = [ref.update(c, is_final=is_final and i == len(chunks) - 1) for i, c in enumerate(chunks)]
    return deltas, ref


def random_chunks(rng: random.Random, text: str) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.choice((1, 1, 1, 2, 3, 5))
        chunks.append(text[i:i + n])
        i += n
    return chunks


# ---- the semantics kept ---------------------------------------------------------------------


def test_of_stops_completed_together_the_earliest_starting_is_cut():
    # "abcd" starts before "bc" though it ends after it; fed at once, the cut is before "a"
    deltas, detok = detokenize(["xabcd", "tail"], ("bc", "abcd"))
    assert deltas == ["x", ""] and detok.stopped and detok.text == "x"
    # fed as "xabc" then "d", "bc" is complete first and wins
    deltas, detok = detokenize(["xabc", "d", "tail"], ("bc", "abcd"))
    assert deltas == ["xa", "", ""] and detok.text == "xa"


def test_include_stop_str_in_output_keeps_the_stop_string_and_cuts_what_follows():
    deltas, detok = detokenize(["the cat", " sat. E", "ND and", " more"], ("END",), include=True)
    assert deltas == ["the cat", " sat. ", "END", ""] and detok.stopped and detok.text == "the cat sat. END"
    # the earliest-starting string is kept whole, though a shorter one inside it ends first
    deltas, detok = detokenize(["xabcd", "tail"], ("bc", "abcd"), include=True)
    assert deltas == ["xabcd", ""] and detok.text == "xabcd"


def test_overlapping_occurrence_is_found_and_cut_at_its_start():
    deltas, detok = detokenize(["a", "a", "a", "b", "c"], ("aab",))
    assert deltas == ["", "", "a", "", ""] and detok.text == "a"


def test_text_that_could_become_a_stop_is_held_back_then_released():
    deltas, detok = detokenize(["an E", "N", "D", "less"], ("END.", "xyz"), is_final=False)
    assert deltas == ["an ", "", "", "ENDless"] and not detok.stopped
    # at the end nothing is held back
    deltas, _ = detokenize(["an E", "ND"], ("END.",))
    assert deltas == ["an ", "END"]


def test_nothing_past_a_stop_is_streamed():
    deltas, detok = detokenize(["the cat", " sat. E", "ND and", " more"], ("END",))
    assert "".join(deltas) == "the cat sat. " and detok.stopped
    assert detok.update(list(range(4)), is_final=True) == ""


def test_before_min_tokens_a_completed_stop_does_not_stop():
    """min_tokens: a stop string completed by the first tokens is passed over (and its text
    streamed once it can no longer grow into one); one that ends after them stops, even if it
    began before."""
    chunks = ["xEND", "y", "ab", "E", "ND", "tail"]
    detok = IncrementalDetokenizer.for_prompt(ChunkTokenizer(chunks), 0, ("END",))
    deltas = [detok.update(list(range(i + 1)), is_final=False, may_stop=i + 1 >= 4) for i in range(len(chunks))]
    assert deltas == ["x", "ENDy", "ab", "", ""] + [""] and detok.stopped and detok.text == "xENDyab"
    # armed from the token that completes it: that token stops it
    detok = IncrementalDetokenizer.for_prompt(ChunkTokenizer(["a", "EN", "D"]), 0, ("END",))
    deltas = [detok.update(list(range(i + 1)), is_final=False, may_stop=i + 1 >= 3) for i in range(3)]
    assert deltas == ["a", "", ""] and detok.stopped and detok.text == "a"


def test_matcher_state_is_the_longest_stop_prefix_ending_the_text():
    matcher = StopMatcher(StopStrings(["abcabd", "cax"]))
    held = []
    for ch in "abcabcab":
        assert matcher.feed(ch) is None
        held.append(matcher.num_held)
    # after "abcab" a "c" is no "d": the state falls back to "abc" (its failure link), not to nothing
    assert held == [1, 2, 3, 4, 5, 3, 4, 5]
    assert matcher.feed("d") == 3 and matcher.num_chars == 9


# ---- the automaton against the brute force -----------------------------------------------------


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("alphabet", ["ab", "abc", "ab\u00e9\U0001f642"])
def test_random_texts_and_stop_sets_match_the_brute_force(alphabet, include):
    rng = random.Random(alphabet)
    for trial in range(400):
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        chunks = random_chunks(rng, text) or [""]
        is_final = rng.random() < 0.5
        got, detok = detokenize(chunks, stops, is_final, include)
        want, ref = brute_force(chunks, stops, is_final, include)
        assert (got, detok.stopped, detok.text) == (want, ref.stopped, ref.text), (stops, chunks, is_final)


def test_matcher_holds_back_exactly_what_the_brute_force_does():
    rng = random.Random(7)
    for trial in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
        matcher = StopMatcher(StopStrings(stops))
        text = ""
        for _ in range(30):
            ch = rng.choice("abc")
            text += ch
            hit = matcher.feed(ch)
            ends = [len(text) - len(s) for s in stops if text.endswith(s)]
            assert hit == (min(ends) if ends else None), (stops, text)
            if hit is not None:
                break
            assert matcher.num_held == longest_stop_prefix_suffix(text, stops), (stops, text)


def test_the_largest_allowed_set_matches_the_brute_force():
    rng = random.Random(3)
    # many strings sharing prefixes, so the automaton's failure links are exercised
    stops: set[str] = set()
    while len(stops) < MAX_STOP_STRINGS:
        stops.add("".join(rng.choice("abcd") for _ in range(rng.randint(2, 64))))
    stops = tuple(stops)
    assert len(stops) == MAX_STOP_STRINGS and sum(map(len, stops)) <= MAX_STOP_CHARS
    for trial in range(20):
        text = "".join(rng.choice("abcd") for _ in range(200))
        chunks = random_chunks(rng, text)
        got, detok = detokenize(chunks, stops)
        want, ref = brute_force(chunks, stops)
        assert (got, detok.text) == (want, ref.text)


def test_the_automaton_is_built_as_the_text_walks_it():
    stops = StopStrings(["stop here", "halt", "x" * 1000])
    assert stops.num_nodes == 1  # a sort and the root: nothing built up front
    matcher = StopMatcher(stops)
    assert matcher.feed("we never reach any") is None
    assert stops.num_nodes < 10
    # the samples of a request share it; each walks with its own state
    other = StopMatcher(stops)
    assert matcher.feed(" halt") == 19 and other.feed("hal") is None and other.num_held == 3


def test_duplicate_stop_strings_are_one():
    deltas, detok = detokenize(["ab", "cd"], ("cd", "cd", "d"))
    assert deltas == ["ab", ""] and detok.text == "ab"


# ---- limits ----------------------------------------------------------------------------------


def test_stop_string_limits_are_refused_naming_the_limit():
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS)])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} stop strings are allowed, got 10000"):
        SamplingParams(stop=[f"s{i}" for i in range(10_000)])
    SamplingParams(stop=["x" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_CHARS} characters in all, got {MAX_STOP_CHARS + 1}"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)])
