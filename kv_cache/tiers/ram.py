"""RAM tier: a byte budget shared by every in-memory cache, with LRU eviction across them,
and per-tenant quotas with guaranteed shares (the rule is in ``kv_cache.tiers.quota``).

```
 reserve(n, ns)
   ns has a quota and would exceed it:  evict ns's own LRU entries (any member cache)
   the budget would be exceeded:        evict the LRU entry among ns and the tenants above
                                        their guarantee (budgeted member caches only)
   neither possible (pinned entries):   refuse
```

Members are the caches holding tenant bytes: budgeted ones (the KV prefix cache) charge this
tier's budget; unbudgeted ones (the vision-feature cache, which has its own budget) only count
toward their tenants' quotas, so a tenant's quota covers both.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import psutil

from kv_cache.tiers.quota import Namespace, eviction_candidates

DEFAULT_RAM_FRACTION = 0.20
MIN_RAM_BUDGET = 100 * 1024 * 1024


def default_ram_budget() -> int:
    """20% of the RAM available now, but at least 100 MiB."""
    return max(int(psutil.virtual_memory().available * DEFAULT_RAM_FRACTION), MIN_RAM_BUDGET)


class Evictor(Protocol):
    """A cache holding tenant bytes that can give them back, oldest first per namespace."""

    def usage(self) -> Mapping[Namespace, int]:
        """Bytes held per namespace (namespaces holding none may be missing)."""
        ...

    def oldest_access(self, namespace: Namespace) -> int | None:
        """Clock stamp of the entry of ``namespace`` that would be evicted next, or None if
        none can be."""
        ...

    def evict_oldest(self, namespace: Namespace) -> int:
        """Evict that entry (a budgeted member discharges its bytes from the tier); returns
        the bytes freed."""
        ...


@dataclass(slots=True)
class RamStats:
    """Budget-level counters.

    Attributes:
        evictions: Entries evicted to make room.
        evicted_bytes: Bytes freed by those evictions.
        failed_reserves: Reservations refused because referenced entries fill the budget
            (or the request exceeds the whole budget).
        quota_evictions: Of ``evictions``, those of a tenant's own entries for its quota.
        quota_refusals: Of ``failed_reserves``, those refused by the requester's quota.
    """

    evictions: int = 0
    evicted_bytes: int = 0
    failed_reserves: int = 0
    quota_evictions: int = 0
    quota_refusals: int = 0


class RamTier:
    """Byte accounting for resident cache entries.

    Caches charge the bytes of what they admit and discharge what they drop. ``reserve`` makes
    room by evicting, from whichever registered evictor holds it, the least recently used
    unreferenced entry allowed by the quota rule, using this tier's shared clock so ages
    compare across caches.

    Args:
        budget_bytes: Byte budget; None means ``default_ram_budget()``.
    """

    __slots__ = ("_budget", "_used", "_evictors", "_members", "_quotas", "_clock", "stats")

    def __init__(self, budget_bytes: int | None = None) -> None:
        self._budget = default_ram_budget() if budget_bytes is None else _check_budget(budget_bytes)
        self._used = 0
        self._evictors: list[Evictor] = []  # budgeted members
        self._members: list[Evictor] = []  # every member (quota accounting)
        self._quotas: dict[Namespace, int] = {}
        self._clock = itertools.count(1)
        self.stats = RamStats()

    @property
    def budget_bytes(self) -> int:
        """The byte budget."""
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Bytes currently charged (resident, or held by users of dropped entries)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Budget not charged (negative after the budget shrank below use)."""
        return self._budget - self._used

    def tick(self) -> int:
        """Next access stamp of the shared LRU clock."""
        return next(self._clock)

    def register(self, evictor: Evictor, *, budgeted: bool = True) -> None:
        """Let ``reserve`` evict from ``evictor``.

        Args:
            evictor: The member cache.
            budgeted: Whether its bytes are charged to this tier's budget (else they only
                count toward their tenants' quotas).
        """
        if any(known is evictor for known in self._members):
            raise ValueError(f"evictor {evictor!r} is already registered")
        self._members.append(evictor)
        if budgeted:
            self._evictors.append(evictor)

    # -- quotas --------------------------------------------------------------------------------

    def set_quota(self, namespace: Namespace, quota_bytes: int | None) -> bool:
        """Set (or with None remove) a tenant's quota, evicting its own entries until it fits.

        Returns:
            False when its referenced entries keep it above the new quota.
        """
        if quota_bytes is None:
            self._quotas.pop(namespace, None)
            return True
        self._quotas[namespace] = _check_budget(quota_bytes)
        return self._fit_quota(namespace, 0)

    def quota(self, namespace: Namespace) -> int | None:
        """A tenant's quota, or None."""
        return self._quotas.get(namespace)

    @property
    def quotas(self) -> Mapping[Namespace, int]:
        """Quota per namespace (read only)."""
        return dict(self._quotas)

    def usage_of(self, namespace: Namespace) -> int:
        """Bytes a tenant holds in every member cache (what its quota bounds)."""
        return sum(member.usage().get(namespace, 0) for member in self._members)

    def budget_usage(self) -> dict[Namespace, int]:
        """Bytes per tenant in the budgeted member caches (what the guarantees protect)."""
        total: dict[Namespace, int] = {}
        for evictor in self._evictors:
            for ns, used in evictor.usage().items():
                total[ns] = total.get(ns, 0) + used
        return total

    def make_quota_room(self, namespace: Namespace, nbytes: int) -> bool:
        """Evict the tenant's own LRU entries until ``nbytes`` more fit its quota (the budget
        is not considered: for members with a budget of their own).

        Returns:
            True when they now fit (always without a quota).
        """
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size: {nbytes}")
        return self._fit_quota(namespace, nbytes)

    def set_budget(self, budget_bytes: int) -> bool:
        """Change the budget, evicting until use fits.

        Returns:
            False when referenced entries keep use above the new budget.
        """
        self._budget = _check_budget(budget_bytes)
        return self.reserve(0)

    def reserve(self, nbytes: int, namespace: Namespace = None) -> bool:
        """Make room for ``nbytes`` more of tenant ``namespace``; charges nothing.

        First the tenant's quota (its own least recently used entries go), then the budget
        (the least recently used entry of the tenant or of a tenant above its guarantee goes).

        Returns:
            True when the bytes now fit the quota and the budget; False when they cannot (the
            rest is referenced, or ``nbytes`` exceeds the whole quota or budget, in which case
            nothing is evicted).
        """
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size: {nbytes}")
        if nbytes > self._budget:
            self.stats.failed_reserves += 1
            return False
        if not self._fit_quota(namespace, nbytes):
            self.stats.failed_reserves += 1
            self.stats.quota_refusals += 1
            return False
        while self._used + nbytes > self._budget:
            candidates = eviction_candidates(self._budget, self._quotas, self.budget_usage(), namespace)
            if not self._evict_oldest(self._evictors, candidates):
                self.stats.failed_reserves += 1
                return False
        return True

    def charge(self, nbytes: int) -> None:
        """Account ``nbytes`` newly held (call ``reserve`` first to stay within budget)."""
        if nbytes < 0:
            raise ValueError(f"cannot charge a negative size: {nbytes}")
        self._used += nbytes

    def discharge(self, nbytes: int) -> None:
        """Account ``nbytes`` no longer held."""
        if not 0 <= nbytes <= self._used:
            raise ValueError(f"cannot discharge {nbytes} bytes with {self._used} charged")
        self._used -= nbytes

    def _fit_quota(self, namespace: Namespace, nbytes: int) -> bool:
        quota = self._quotas.get(namespace)
        if quota is None:
            return True
        if nbytes > quota:
            return False  # nothing evicted: it could never fit
        while self.usage_of(namespace) + nbytes > quota:
            if not self._evict_oldest(self._members, (namespace,)):
                return False
            self.stats.quota_evictions += 1
        return True

    def _evict_oldest(self, members: list[Evictor], namespaces: Iterable[Namespace]) -> bool:
        """Evict the least recently used entry of ``namespaces`` among ``members``."""
        best: tuple[int, Evictor, Namespace] | None = None
        for ns in namespaces:
            for member in members:
                age = member.oldest_access(ns)
                if age is not None and (best is None or age < best[0]):
                    best = (age, member, ns)
        if best is None:
            return False
        _, member, ns = best
        before = self._used
        freed = member.evict_oldest(ns)
        budgeted = any(member is known for known in self._evictors)
        assert not budgeted or self._used == before - freed, "evictor must discharge what it frees"
        self.stats.evictions += 1
        self.stats.evicted_bytes += freed
        return True


def _check_budget(budget_bytes: int) -> int:
    if budget_bytes < 0:
        raise ValueError(f"RAM budget must be >= 0 bytes, got {budget_bytes}")
    return budget_bytes
