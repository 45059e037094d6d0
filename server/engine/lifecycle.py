"""The engine's tenancy lifecycle: quotas applied, retention swept, sessions and tenants erased.

```
 observe(tenant)      each request and, at startup, every tenant of the registry: the RAM tier
                      and the SSD tier get the tenant's quotas, the policy table its retention
 cutoff(namespace)    now - retention: lookups and feature reads treat older state as a miss
 sweep()              every tier drops state past its tenant's retention (+ quarantined files)
 erase_session(t, s)  KV blocks and vision features only session s of tenant t owns, in RAM and
                      on SSD, and the replies s generated (reply ledger)
 erase_tenant(t)      everything of tenant t: RAM blocks and features, every SSD record of its
                      namespace, its quarantined files, its replies
```
Runs on the engine thread (the caller is the runner), between requests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kv_cache import retention
from kv_cache.erasure import KvErasure, erase_owner, erase_resident_namespace
from kv_cache.hashing import BlockHash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tally import Tally
from kv_cache.tiers.ram import RamTier
from kv_cache.tiers.ssd import SsdTier
from kv_cache.tiers.ssd_index import RecordKind
from kv_cache.tiers.ssd_maintenance import expire_quarantine
from server.engine.prompt import ReplyLedger
from tenancy.policies import PolicyTable
from tenancy.tenants import Tenant, TenantId
from vision_cache.erasure import FeatureErasure, erase_feature_owner
from vision_cache.feature_cache import FeatureCache
from vision_cache.ssd import FeatureSsd


@dataclass(frozen=True, slots=True)
class ErasureReport:
    """What one erasure removed.

    Attributes:
        tenant: The tenant erased from.
        session: The session erased (None: the whole tenant).
        kv_ram: KV blocks removed from RAM and their bytes.
        kv_ssd: KV block files removed and their bytes.
        vision_ram: Vision features removed from RAM and their bytes.
        vision_ssd: Vision feature files removed and their bytes.
        kept_shared_blocks: Blocks of the session kept: another session of the tenant owns them.
        kept_shared_features: Features kept for the same reason.
        replies: Reply-ledger entries dropped.
    """

    tenant: TenantId
    session: str | None
    kv_ram: Tally
    kv_ssd: Tally
    vision_ram: Tally
    vision_ssd: Tally
    kept_shared_blocks: int
    kept_shared_features: int
    replies: int


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one retention sweep removed (counts and bytes per tier)."""

    kv_ram: Tally
    kv_ssd: Tally
    vision_ram: Tally
    vision_ssd: Tally
    quarantined_files: int
    replies: int = 0  # reply-ledger entries dropped


class CacheLifecycle:
    """Quotas, retention and erasure over the engine's caches.

    Args:
        ram: The RAM tier (tenant quotas).
        prefix_cache: KV blocks in RAM.
        ssd: The SSD tier, or None.
        features: Vision features in RAM.
        feature_ssd: Vision features on SSD, or None.
        ledger: The reply ledger.
        clock: Wall-clock seconds (the same clock stamps ``stored_at``).
        on_expired: Told each KV block dropped for retention (miss attribution).
    """

    def __init__(
        self,
        *,
        ram: RamTier,
        prefix_cache: PrefixCache,
        ssd: SsdTier | None,
        features: FeatureCache,
        feature_ssd: FeatureSsd | None,
        ledger: ReplyLedger,
        clock: Callable[[], float],
        on_expired: Callable[[BlockHash], None] | None = None,
    ) -> None:
        self._ram = ram
        self._cache = prefix_cache
        self._ssd = ssd
        self._features = features
        self._feature_ssd = feature_ssd
        self._ledger = ledger
        self._clock = clock
        self._on_expired = on_expired
        self.policies = PolicyTable()

    # -- policies ------------------------------------------------------------------------------

    def observe(self, tenant: Tenant) -> None:
        """Apply a tenant's quotas if its settings are new or changed."""
        if self.policies.observe(tenant):
            self._apply(tenant)

    def configure(self, tenants: Iterable[Tenant]) -> None:
        """Apply the settings of every tenant (the registry, at startup)."""
        for tenant in self.policies.observe_all(tenants):
            self._apply(tenant)

    def cutoff(self, namespace: str) -> float | None:
        """``now - retention`` of a tenant, or None without retention."""
        return self.policies.cutoff(namespace, self._clock())

    def _apply(self, tenant: Tenant) -> None:
        settings = tenant.settings
        self._ram.set_quota(tenant.namespace, settings.ram_quota_bytes)
        if self._ssd is not None:
            self._ssd.set_quota(tenant.namespace, settings.ssd_quota_bytes)

    # -- retention -----------------------------------------------------------------------------

    def sweep(self) -> SweepReport:
        """Drop every tenant's state past its retention, in every tier."""
        now = self._clock()
        cutoffs = self.policies.cutoffs(now)
        kv_ram = retention.sweep(self._cache, cutoffs, self._on_expired)
        vision_ram = self._features.expire(cutoffs)
        replies = self._ledger.expire(cutoffs)
        kv_ssd = vision_ssd = Tally()
        quarantined = 0
        if self._ssd is not None and cutoffs:
            removed = self._ssd.expire(cutoffs)
            kv_ssd, vision_ssd = removed[RecordKind.KV], removed[RecordKind.VISION]
            quarantined = expire_quarantine(self._ssd.layout, self.policies.retentions(), now)
        return SweepReport(kv_ram, kv_ssd, vision_ram, vision_ssd, quarantined, replies)

    # -- erasure -------------------------------------------------------------------------------

    def erase_session(self, tenant: Tenant, session: str) -> ErasureReport:
        """Erase what session ``session`` of ``tenant`` alone holds, in every tier."""
        if self._ssd is not None:
            self._ssd.flush()
        kv: KvErasure = erase_owner(self._cache, self._ssd, tenant.namespace, session)
        vision: FeatureErasure = erase_feature_owner(
            self._features, self._feature_ssd, tenant.namespace, session
        )
        if self._ssd is not None:
            self._ssd.compact()
        replies = self._ledger.forget_session(tenant.namespace, session)
        return ErasureReport(
            tenant.tenant_id, session, kv.ram, kv.ssd, vision.ram, vision.ssd,
            kv.kept_shared, vision.kept_shared, replies,
        )

    def erase_tenant(self, tenant: Tenant) -> ErasureReport:
        """Erase everything of ``tenant`` in every tier."""
        kv_ram = erase_resident_namespace(self._cache, tenant.namespace)
        count, nbytes = self._features.remove_namespace(tenant.namespace)
        kv_ssd = vision_ssd = Tally()
        if self._ssd is not None:
            removed = self._ssd.erase_namespace(tenant.namespace)
            kv_ssd, vision_ssd = removed[RecordKind.KV], removed[RecordKind.VISION]
        replies = self._ledger.forget_namespace(tenant.namespace)
        return ErasureReport(
            tenant.tenant_id, None, kv_ram, kv_ssd, Tally(count, nbytes), vision_ssd, 0, 0, replies
        )
