"""Authentication and authorization failures, each carrying its HTTP status.

Messages never contain the presented key: they end up in responses and logs.
"""

from __future__ import annotations

from typing import ClassVar


class AuthError(Exception):
    """Base of every tenancy auth failure.

    Attributes:
        status_code: HTTP status the server answers with.
        code: OpenAI-style error code for the error envelope.
    """

    status_code: ClassVar[int] = 401
    code: ClassVar[str] = "invalid_api_key"


class MissingCredentials(AuthError):
    """No ``Authorization`` header (or an empty one) where a key is required."""


class InvalidCredentials(AuthError):
    """A malformed ``Authorization`` header, or a key that belongs to no tenant."""


class AdminRequired(AuthError):
    """A non-admin tenant called an admin-only operation."""

    status_code: ClassVar[int] = 403
    code: ClassVar[str] = "insufficient_permissions"


class UnknownTenant(LookupError):
    """A tenant id that the registry does not know."""
