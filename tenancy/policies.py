"""Tenant limits by storage namespace: what the cache tiers need to apply quotas and retention.

The tiers know tenants only by namespace (a digest of the salt). This table maps namespaces to
the settings of the keys file, fed with every tenant of the registry at startup (so retention
also reaches tenants whose state is only on disk) and with each request's tenant.
"""

from __future__ import annotations

from collections.abc import Iterable

from tenancy.tenants import Tenant, TenantSettings


class PolicyTable:
    """Settings of every known tenant, by storage namespace."""

    __slots__ = ("_settings",)

    def __init__(self) -> None:
        self._settings: dict[str, TenantSettings] = {}

    def observe(self, tenant: Tenant) -> bool:
        """Record a tenant's settings.

        Returns:
            True when they are new or changed (the caller re-applies quotas then).
        """
        if self._settings.get(tenant.namespace) == tenant.settings:
            return False
        self._settings[tenant.namespace] = tenant.settings
        return True

    def observe_all(self, tenants: Iterable[Tenant]) -> list[Tenant]:
        """Record several tenants. Returns those whose settings were new or changed."""
        return [tenant for tenant in tenants if self.observe(tenant)]

    def settings(self, namespace: str) -> TenantSettings | None:
        """A namespace's settings, or None for an unknown one."""
        return self._settings.get(namespace)

    def retention(self, namespace: str) -> float | None:
        """A namespace's retention in seconds, or None."""
        settings = self._settings.get(namespace)
        return settings.retention_seconds if settings is not None else None

    def cutoff(self, namespace: str, now: float) -> float | None:
        """``now - retention`` of a namespace (content stored before it is expired), or None."""
        retention = self.retention(namespace)
        return None if retention is None else now - retention

    def retentions(self) -> dict[str, float]:
        """Retention in seconds of every namespace that has one."""
        return {
            ns: settings.retention_seconds
            for ns, settings in self._settings.items()
            if settings.retention_seconds is not None
        }

    def cutoffs(self, now: float) -> dict[str, float]:
        """``now - retention`` of every namespace that has a retention."""
        return {ns: now - seconds for ns, seconds in self.retentions().items()}
