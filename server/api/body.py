"""Request bodies: JSON bytes -> wire Struct, with OpenAI-style errors.

The body is decoded here rather than by Litestar so that malformed JSON (400) and wrong types
(422) get distinct statuses, both in the OpenAI envelope and naming the field.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from server.api.errors import ApiError

S = TypeVar("S", bound=msgspec.Struct)

_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`")


def _param(message: str) -> str | None:
    """Field path of a msgspec validation message, e.g. ``messages[0].role``."""
    path_match = _PATH.search(message)
    path = path_match.group("path") if path_match else ""
    missing = _MISSING.match(message)
    if missing:
        field = missing.group("field")
        path = f"{path}.{field}" if path else field
    return path or None


def decode_body(body: bytes, type_: type[S]) -> S:
    """Decode a JSON request body into ``type_``.

    Raises:
        ApiError: 400 ``invalid_json`` for bytes that are not JSON; 422 ``invalid_type`` for
            JSON whose shape or types do not match (``param`` names the field).
    """
    if not body.strip():
        raise ApiError(400, "request body is empty; expected a JSON object", code="invalid_json")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        # ValidationError subclasses DecodeError: it must be caught first.
        message = str(exc)
        raise ApiError(422, f"invalid request: {message}", param=_param(message),
                       code="invalid_type") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
