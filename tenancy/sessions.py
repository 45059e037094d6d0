"""Session ids: which conversation of a tenant a request belongs to.

The session id is recorded as an owner of the blocks a request stores, so that one session can
later be erased. It is scoped by the tenant: session ``s1`` of two tenants are unrelated.
"""

from __future__ import annotations

from typing import NewType

SessionId = NewType("SessionId", str)

MAX_SESSION_ID_CHARS = 256


class InvalidSessionId(ValueError):
    """A session id that is too long or not printable.

    Attributes:
        source: Where it came from: ``X-Session-Id``, ``prompt_cache_key`` or ``user``.
    """

    def __init__(self, source: str, message: str) -> None:
        super().__init__(message)
        self.source = source


def resolve_session_id(
    header: str | None, prompt_cache_key: str | None, user: str | None
) -> SessionId | None:
    """Pick the session id: ``X-Session-Id`` header, else ``prompt_cache_key``, else ``user``.

    An empty string counts as absent (clients send ``user=""``), so the next source is used.
    Only the chosen value is validated.

    Args:
        header: Value of the ``X-Session-Id`` header.
        prompt_cache_key: Request body field ``prompt_cache_key``.
        user: Request body field ``user``.

    Returns:
        The session id, or None when no source gives one.

    Raises:
        InvalidSessionId: (a ValueError) naming the source when the chosen value is longer than
            256 characters or contains non-printable characters.
    """
    for source, value in (("X-Session-Id", header), ("prompt_cache_key", prompt_cache_key), ("user", user)):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise InvalidSessionId(source, f"{source} must be a string, got {type(value).__name__}")
        if len(value) > MAX_SESSION_ID_CHARS:
            raise InvalidSessionId(
                source, f"{source} is {len(value)} characters long; the limit is {MAX_SESSION_ID_CHARS}"
            )
        if not value.isprintable():
            raise InvalidSessionId(
                source, f"{source} contains non-printable characters: {value[:64]!r}"
            )
        return SessionId(value)
    return None
