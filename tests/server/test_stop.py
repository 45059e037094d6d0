"""Stop strings on streamed text: hold back possible prefixes, cut at the earliest match."""

from __future__ import annotations

import pytest

from server.api.stop import StopMatcher, StopScan


def _run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    matcher = StopMatcher(stops)
    released: list[str] = []
    for piece in pieces:
        scan = matcher.feed(piece)
        released.append(scan.text)
        if scan.stopped:
            return released, True, ""
    return released, False, matcher.flush()


def test_no_stops_passes_text_through() -> None:
    assert _run([], ["ab", "c"]) == (["ab", "c"], False, "")


def test_stop_inside_one_piece() -> None:
    assert _run(["END"], ["abcENDxyz"]) == (["abc"], True, "")


def test_stop_split_across_pieces_is_never_shown() -> None:
    assert _run(["END"], ["abcE", "N", "Dxyz"]) == (["abc", "", ""], True, "")


def test_held_prefix_released_when_it_is_not_a_stop() -> None:
    assert _run(["END"], ["abcE", "Nx", "y"]) == (["abc", "ENx", "y"], False, "")


def test_held_text_flushed_at_the_end() -> None:
    assert _run(["END"], ["abcEN"]) == (["abc"], False, "EN")


def test_earliest_of_several_stops_wins() -> None:
    assert _run(["world", "lo w"], ["hello world"]) == (["hel"], True, "")


def test_overlapping_partial_keeps_longest_candidate() -> None:
    # Both "a" and "aa" could start "aaX": the longest candidate is held back.
    matcher = StopMatcher(["aaX"])
    assert matcher.feed("xaa") == StopScan("x", False)
    assert matcher.feed("aX") == StopScan("a", True)


def test_empty_stop_strings_are_ignored() -> None:
    assert _run(["", "Z"], ["abc"]) == (["abc"], False, "")


def test_feed_after_stop_is_an_error() -> None:
    matcher = StopMatcher(["x"])
    assert matcher.feed("x").stopped
    with pytest.raises(RuntimeError):
        matcher.feed("more")
