"""Tenants: identity, per-tenant salt and storage namespace, and per-tenant settings.

A tenant's salt is HMAC-SHA256(server secret, tenant id). It seeds the root block hash, the
image hashes and the vision-cache keys, so two tenants never share cached state even for
identical inputs. Disk and Redis namespaces use a digest of the salt, never the raw tenant id,
so a cache directory does not reveal who its tenants are.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import NewType

TenantId = NewType("TenantId", str)

DEFAULT_TENANT_ID = TenantId("default")
"""The single tenant served when no keys file is configured."""

SALT_BYTES = 32
NAMESPACE_HEX_CHARS = 16

# Tenant ids appear in logs, stats and CLI flags (`--tenant T`); a conservative charset keeps
# them safe to print and to pass around, and keeps NUL out so the HMAC inputs of salts and of
# API-key digests (which are prefixed with a NUL-terminated tag) can never coincide.
_TENANT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class TenantSettings:
    """Per-tenant limits. ``None`` means "no tenant-specific limit" (the server-wide one applies).

    Enforced by the cache tiers (``kv_cache.tiers.quota`` for the share rule, the engine's
    ``server.engine.lifecycle`` for wiring); the rules are in the README, section Tenancy.

    Attributes:
        ram_quota_bytes: Most bytes of RAM-tier cache state (KV blocks and vision features)
            this tenant may hold; also its guaranteed share of the RAM budget (scaled down when
            the quotas of the tenants present add up to more than the budget).
        ssd_quota_bytes: Most bytes of SSD-tier files this tenant may hold, and its guaranteed
            share of the SSD budget, by the same rule.
        retention_seconds: Time to live of this tenant's cached state in every tier, counted
            from when the state was computed.
        allow_http_images: Whether this tenant may send http(s) image URLs (also needs the
            server-wide switch).
    """

    ram_quota_bytes: int | None = None
    ssd_quota_bytes: int | None = None
    retention_seconds: float | None = None
    allow_http_images: bool = False

    def __post_init__(self) -> None:
        for name in ("ram_quota_bytes", "ssd_quota_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer number of bytes, got {value!r}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        retention = self.retention_seconds
        if retention is not None:
            if isinstance(retention, bool) or not isinstance(retention, (int, float)):
                raise ValueError(f"retention_seconds must be a number, got {retention!r}")
            if not retention > 0 or retention == float("inf"):
                raise ValueError(f"retention_seconds must be a finite number > 0, got {retention}")
        if not isinstance(self.allow_http_images, bool):
            raise ValueError(f"allow_http_images must be a boolean, got {self.allow_http_images!r}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant as the rest of the server sees it.

    Build with :func:`make_tenant` so that salt and namespace are derived consistently.

    Attributes:
        tenant_id: Name from the keys file (``default`` without one).
        salt: HMAC-SHA256(server secret, tenant id), 32 bytes. Kept out of ``repr``.
        namespace: Short hex digest of the salt, used for on-disk and Redis names.
        is_admin: May see every tenant's stats and erase any tenant.
        settings: Quotas, retention and image-URL policy.
    """

    tenant_id: TenantId
    salt: bytes = field(repr=False)
    namespace: str
    is_admin: bool = False
    settings: TenantSettings = TenantSettings()


def validate_tenant_id(tenant_id: str) -> TenantId:
    """Check a tenant id's syntax.

    Args:
        tenant_id: Candidate id.

    Returns:
        The same string typed as ``TenantId``.

    Raises:
        ValueError: Naming the id when it is not 1-64 characters of ``[A-Za-z0-9._-]`` starting
            with a letter or digit.
    """
    if not isinstance(tenant_id, str) or _TENANT_ID_RE.fullmatch(tenant_id) is None:
        raise ValueError(
            f"invalid tenant id {tenant_id!r}: use 1-64 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return TenantId(tenant_id)


def tenant_salt(secret: bytes, tenant_id: TenantId) -> bytes:
    """HMAC-SHA256(secret, UTF-8 tenant id): 32 bytes, stable for one secret.

    Args:
        secret: The server secret (see ``tenancy.secret``).
        tenant_id: A valid tenant id.

    Returns:
        The tenant's salt.
    """
    validate_tenant_id(tenant_id)
    if len(secret) == 0:
        raise ValueError("server secret is empty")
    return hmac.new(secret, tenant_id.encode("utf-8"), hashlib.sha256).digest()


def tenant_namespace(salt: bytes) -> str:
    """First 16 hex characters of sha256(b"ns" + salt): a storage name that hides the tenant id.

    Args:
        salt: A tenant salt.

    Returns:
        16 lowercase hex characters.
    """
    return hashlib.sha256(b"ns" + salt).hexdigest()[:NAMESPACE_HEX_CHARS]


def make_tenant(
    secret: bytes,
    tenant_id: str,
    *,
    is_admin: bool = False,
    settings: TenantSettings | None = None,
) -> Tenant:
    """Derive a tenant's salt and namespace from the server secret.

    Args:
        secret: The server secret.
        tenant_id: Tenant name (validated by :func:`validate_tenant_id`).
        is_admin: Whether the tenant has the admin role.
        settings: Per-tenant settings; defaults to no limits.

    Returns:
        The tenant.
    """
    tid = validate_tenant_id(tenant_id)
    salt = tenant_salt(secret, tid)
    return Tenant(
        tenant_id=tid,
        salt=salt,
        namespace=tenant_namespace(salt),
        is_admin=is_admin,
        settings=settings if settings is not None else TenantSettings(),
    )
