"""StopMatcher: stop strings found across any chunking, held back no longer than needed."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from inference.stops import StopMatcher

# A small alphabet makes overlaps and near-misses common; multi-byte and multi-codepoint
# characters included (the matcher works on str, so they are single characters or sequences).
_alphabet = st.sampled_from(["a", "b", " ", "\n", "中", "é", "😀", "\u200d", "<", "/"])
_texts = st.lists(_alphabet, max_size=30).map("".join)
_stop_strings = st.lists(_alphabet, min_size=1, max_size=4).map("".join)


def inside(inner: str, outer: str) -> bool:
    """Whether ``inner`` occurs in ``outer`` other than at its start or its end."""
    return any(outer.startswith(inner, i) for i in range(1, len(outer) - len(inner)))


def first_stop(text: str, stops: list[str]) -> int:
    """Where the text is cut: before the stop occurrence that is complete first, i.e. ends
    first (ties: starts first); len(text) if none."""
    found = [(i + len(stop), i) for stop in stops if (i := text.find(stop)) >= 0]
    return min(found, default=(len(text), len(text)))[1]


def held_reference(text: str, stops: list[str]) -> str:
    """The longest suffix of ``text`` that is a proper prefix of a stop: what must be held."""
    for size in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        suffix = text[-size:]
        if any(len(stop) > size and stop.startswith(suffix) for stop in stops):
            return suffix
    return ""


def chunked(data: st.DataObject, text: str) -> list[str]:
    offsets = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    bounds = sorted({0, len(text), *offsets})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    if data.draw(st.booleans()):
        chunks.insert(data.draw(st.integers(0, len(chunks))), "")
    return chunks


@st.composite
def texts_and_stops(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(_texts)
    stops = draw(st.lists(_stop_strings, min_size=1, max_size=4))
    if text and draw(st.booleans()):
        # A stop taken from the text itself, so that hits are common.
        start = draw(st.integers(0, len(text) - 1))
        end = draw(st.integers(start + 1, min(len(text), start + 4)))
        stops[draw(st.integers(0, len(stops) - 1))] = text[start:end]
    return text, stops


@settings(max_examples=300, deadline=None)
@given(case=texts_and_stops(), data=st.data())
def test_any_chunking_cuts_before_the_first_stop(
    case: tuple[str, list[str]], data: st.DataObject
) -> None:
    text, stops = case
    longest = max(map(len, stops))
    cut = first_stop(text, stops)
    matcher = StopMatcher(stops)
    emitted = ""
    fed = ""
    stopped = False
    for chunk in chunked(data, text):
        out, stopped = matcher.push(chunk)
        fed += chunk
        emitted += out
        # Stopped exactly when the text so far holds a complete stop string.
        assert stopped == any(stop in fed for stop in stops)
        if stopped:
            break
        assert fed.startswith(emitted)
        held = fed[len(emitted) :]
        assert len(held) <= longest - 1
        # Text that cannot begin a stop string is released at once.
        assert held == held_reference(fed, stops)
    if not stopped:
        emitted += matcher.flush()
    assert emitted == text[:cut]
    assert stopped == any(stop in text for stop in stops)
    for stop in stops:
        assert stop not in emitted


@settings(max_examples=100, deadline=None)
@given(text=_texts, data=st.data())
def test_no_stops_passes_everything_through_at_once(text: str, data: st.DataObject) -> None:
    matcher = StopMatcher(["", ""])  # empty stop strings are ignored
    for chunk in chunked(data, text):
        assert matcher.push(chunk) == (chunk, False)
    assert matcher.flush() == ""


def test_stop_split_across_chunks() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("Hello <") == ("Hello ", False)
    assert matcher.push("/") == ("", False)
    assert matcher.push("s> ignored") == ("", True)


def test_false_start_is_released_when_it_cannot_be_a_stop() -> None:
    matcher = StopMatcher(["</s>"])
    assert matcher.push("a </") == ("a ", False)
    assert matcher.push("x") == ("</x", False)
    assert matcher.flush() == ""


def test_held_text_comes_out_at_flush() -> None:
    matcher = StopMatcher(["STOP", "中文"])
    assert matcher.push("x ST") == ("x ", False)
    assert matcher.push("中") == ("ST", False)
    assert matcher.flush() == "中"
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    matcher = StopMatcher(["bc", "ab"])
    assert matcher.push("xabc") == ("x", True)


def test_non_ascii_stop() -> None:
    matcher = StopMatcher(["😀\u200d"])
    assert matcher.push("hi 😀") == ("hi ", False)
    assert matcher.push("\u200d🔥") == ("", True)


def test_stop_inside_another_stop_is_chunking_independent() -> None:
    stops = ["\n\nUser:", "User"]
    whole = StopMatcher(stops).push("Hi\n\nUser: x")
    tokens = StopMatcher(stops)
    by_token = ""
    for chunk in ["Hi", "\n\n", "User", ":", " x"]:
        out, stopped = tokens.push(chunk)
        by_token += out
        if stopped:
            break
    assert stopped
    assert whole == (by_token, True)  # by token "Hi\n\n", in one chunk "Hi"
