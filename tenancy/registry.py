"""The set of tenants a server knows, and API-key authentication against it."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

from tenancy.errors import AdminRequired, InvalidCredentials, MissingCredentials, UnknownTenant
from tenancy.keys import TenantEntry, load_keys_file
from tenancy.tenants import DEFAULT_TENANT_ID, Tenant, TenantId, make_tenant

# Tag for key digests; tenant ids cannot contain NUL, so these HMAC inputs never equal a salt's.
_KEY_DIGEST_TAG = b"vlmcache-api-key\x00"


def _key_digest(digest_key: bytes, api_key: str) -> bytes:
    return hmac.new(digest_key, _KEY_DIGEST_TAG + api_key.encode("utf-8"), hashlib.sha256).digest()


class TenantRegistry:
    """Tenants by id and by API key.

    Keys are held only as HMAC-SHA256 digests under the server secret. A lookup hashes the
    presented key and finds its digest in a dict: the dict's timing depends on the digest, which
    an attacker cannot steer byte by byte, never on how many leading characters of a real key
    were guessed right. The found digest is then confirmed with ``hmac.compare_digest``.
    """

    __slots__ = ("_tenants", "_tenant_by_digest", "_digest_key", "_requires_auth")

    def __init__(
        self,
        tenants: Iterable[Tenant],
        keys: Mapping[str, TenantId],
        *,
        digest_key: bytes,
        requires_auth: bool,
    ) -> None:
        """Build a registry; prefer :meth:`from_keys_file` or :meth:`single_default`.

        Args:
            tenants: Every tenant.
            keys: API key -> tenant id (each id must be in ``tenants``).
            digest_key: Secret under which API keys are digested.
            requires_auth: Whether ``authenticate`` demands a valid key.
        """
        self._tenants: dict[TenantId, Tenant] = {}
        for tenant in tenants:
            if tenant.tenant_id in self._tenants:
                raise ValueError(f"tenant {tenant.tenant_id!r} given twice")
            self._tenants[tenant.tenant_id] = tenant
        if requires_auth and not keys:
            raise ValueError("a registry that requires auth needs at least one API key")
        self._digest_key = digest_key
        # digest -> (the same digest as stored, tenant): the stored copy is what the
        # constant-time comparison checks the presented key's digest against.
        self._tenant_by_digest: dict[bytes, tuple[bytes, TenantId]] = {}
        for key, tenant_id in keys.items():
            if tenant_id not in self._tenants:
                raise ValueError(f"API key mapped to unknown tenant {tenant_id!r}")
            digest = _key_digest(digest_key, key)
            self._tenant_by_digest[digest] = (digest, tenant_id)
        self._requires_auth = requires_auth

    @classmethod
    def from_entries(cls, entries: Iterable[TenantEntry], secret: bytes) -> TenantRegistry:
        """Registry for parsed keys-file entries (auth required).

        Args:
            entries: Output of ``tenancy.keys.parse_keys_toml`` / ``load_keys_file``.
            secret: The server secret (salts and key digests derive from it).
        """
        tenants: list[Tenant] = []
        keys: dict[str, TenantId] = {}
        for entry in entries:
            tenants.append(
                make_tenant(secret, entry.tenant_id, is_admin=entry.is_admin, settings=entry.settings)
            )
            for key in entry.keys:
                if key in keys:
                    raise ValueError(
                        f"an API key of tenant {entry.tenant_id!r} is also a key of {keys[key]!r}"
                    )
                keys[key] = entry.tenant_id
        return cls(tenants, keys, digest_key=secret, requires_auth=True)

    @classmethod
    def from_keys_file(cls, path: Path, secret: bytes) -> TenantRegistry:
        """Registry from a TOML keys file (format in ``tenancy.keys``); auth required.

        Raises:
            KeysFileError: The file is unreadable or malformed.
        """
        return cls.from_entries(load_keys_file(path), secret)

    @classmethod
    def single_default(cls, secret: bytes) -> TenantRegistry:
        """One ``default`` tenant and no keys: every request is that tenant.

        The default tenant is admin: it is the only tenant, so "all tenants" is itself.
        """
        tenant = make_tenant(secret, DEFAULT_TENANT_ID, is_admin=True)
        return cls([tenant], {}, digest_key=secret, requires_auth=False)

    @property
    def requires_auth(self) -> bool:
        """Whether requests must carry a valid ``Authorization: Bearer <key>`` header."""
        return self._requires_auth

    def authenticate(self, authorization_header: str | None) -> Tenant:
        """Map an ``Authorization`` header to its tenant.

        Without a keys file the header is ignored and the default tenant is returned.

        Args:
            authorization_header: The raw header value, or None when absent.

        Returns:
            The authenticated tenant.

        Raises:
            MissingCredentials: No header, or an empty one (401).
            InvalidCredentials: Not ``Bearer <key>``, or an unknown key (401).
        """
        if not self._requires_auth:
            (tenant,) = self._tenants.values()
            return tenant
        if authorization_header is None or authorization_header.strip() == "":
            raise MissingCredentials(
                "missing API key: send 'Authorization: Bearer <key>'"
            )
        scheme, _, token = authorization_header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or token == "":
            raise InvalidCredentials(
                "malformed Authorization header: expected 'Bearer <key>'"
            )
        digest = _key_digest(self._digest_key, token)
        found = self._tenant_by_digest.get(digest)
        if found is None:
            raise InvalidCredentials("incorrect API key provided")
        stored_digest, tenant_id = found
        # The dict matched on the digest already; compare_digest keeps the final check
        # constant-time should the lookup structure ever change.
        if not hmac.compare_digest(stored_digest, digest):
            raise InvalidCredentials("incorrect API key provided")
        return self._tenants[tenant_id]

    def get(self, tenant_id: str) -> Tenant:
        """The tenant with this id.

        Raises:
            UnknownTenant: Naming the id.
        """
        try:
            return self._tenants[TenantId(tenant_id)]
        except KeyError:
            raise UnknownTenant(f"unknown tenant {tenant_id!r}") from None

    def all(self) -> tuple[Tenant, ...]:
        """Every tenant, in keys-file order."""
        return tuple(self._tenants.values())

    def by_namespace(self, namespace: str) -> Tenant:
        """The tenant whose storage namespace is ``namespace`` (for stats over disk state).

        Raises:
            UnknownTenant: Naming the namespace.
        """
        for tenant in self._tenants.values():
            if tenant.namespace == namespace:
                return tenant
        raise UnknownTenant(f"no tenant has namespace {namespace!r}")


def require_admin(tenant: Tenant) -> None:
    """Raise ``AdminRequired`` (403) unless the tenant has the admin role."""
    if not tenant.is_admin:
        raise AdminRequired(f"tenant {tenant.tenant_id!r} is not an admin")
