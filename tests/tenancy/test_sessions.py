from __future__ import annotations

import pytest

from tenancy.sessions import InvalidSessionId, resolve_session_id


@pytest.mark.parametrize(
    ("header", "key", "user", "expected"),
    [
        ("h", "k", "u", "h"),
        (None, "k", "u", "k"),
        (None, None, "u", "u"),
        (None, None, None, None),
        ("", "k", "u", "k"),
        ("", "", "u", "u"),
        ("", "", "", None),
        ("h", None, None, "h"),
        (None, "k", None, "k"),
    ],
)
def test_precedence(header, key, user, expected) -> None:
    assert resolve_session_id(header, key, user) == expected


def test_max_length_accepted() -> None:
    assert resolve_session_id("s" * 256, None, None) == "s" * 256


@pytest.mark.parametrize(
    ("args", "source"),
    [
        (("s" * 257, None, None), "X-Session-Id"),
        ((None, "k" * 300, None), "prompt_cache_key"),
        ((None, None, "u" * 1000), "user"),
    ],
)
def test_too_long_names_source(args, source) -> None:
    with pytest.raises(InvalidSessionId, match=f"^{source} is .* characters long") as info:
        resolve_session_id(*args)
    assert info.value.source == source
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("args", "source"),
    [
        (("a\nb", None, None), "X-Session-Id"),
        ((None, "tab\there", None), "prompt_cache_key"),
        ((None, None, "nul\x00"), "user"),
    ],
)
def test_non_printable_names_source(args, source) -> None:
    with pytest.raises(InvalidSessionId, match=f"^{source} contains non-printable") as info:
        resolve_session_id(*args)
    assert info.value.source == source


def test_only_chosen_value_is_validated() -> None:
    # The header wins, so a bad `user` is irrelevant.
    assert resolve_session_id("ok", None, "bad\n") == "ok"
