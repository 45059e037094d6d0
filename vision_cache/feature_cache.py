"""RAM cache of vision-encoder outputs: a bytes-budgeted LRU keyed by (image hash, model).

Image hashes are tenant-salted, so entries of different tenants never share a key; each entry
also records the namespace of the tenant that stored it (per-tenant stats, quota, erasure), the
sessions that used it (``owners``: session erasure) and when it was computed (``stored_at``:
retention counts from it, and it is kept when the SSD tier hands the features back).

Eviction (to make room) calls ``on_evict(key, features)`` so a later SSD tier can spill the
entry. Explicit removal (:meth:`FeatureCache.remove`, :meth:`FeatureCache.remove_namespace`,
:meth:`FeatureCache.erase`, expiry) is erasure and never calls it: erased data must not reappear
in another tier.

Quotas: joined to a ``RamTier`` (``ram=``), the cache is an unbudgeted member of it: its bytes
count toward each tenant's RAM quota together with the tenant's KV blocks, its access stamps come
from the tier's clock (so a tenant over its quota loses its oldest entry of either cache), and
``put`` first makes quota room. The vision budget itself stays separate and plain LRU across
tenants: with the SSD tier on, features are written through, so evicting them loses only a read.

Thread-safe: the engine thread reads and writes, HTTP threads read stats. ``on_evict`` runs
after the lock is released, so it may call back into the cache.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kv_cache.sizing import tree_nbytes
from kv_cache.tally import Tally
from kv_cache.tiers.ram import RamTier
from vision_cache.hashing import ImageHash

EvictCallback = Callable[["FeatureKey", "CachedFeatures"], None]


@dataclass(frozen=True, slots=True)
class FeatureKey:
    """What identifies one image's features: its salted pixel hash and the model that made them.

    Attributes:
        image_hash: Tenant-salted pixel hash (``vision_cache.hashing.image_hash``).
        model_fingerprint: Identity of the model + processor configuration that encoded it.
    """

    image_hash: ImageHash
    model_fingerprint: str


@dataclass(frozen=True, slots=True)
class CachedFeatures:
    """One image's encoder output.

    Attributes:
        features: The projected features: an array or any structure of arrays; opaque here.
        meta: Small per-image facts needed to use them (grid thw, number of tokens, ...).
        nbytes: Memory the features hold; see :func:`features_nbytes`.
    """

    features: Any
    meta: Mapping[str, Any]
    nbytes: int

    def __post_init__(self) -> None:
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0, got {self.nbytes!r}")

    @classmethod
    def of(cls, features: Any, meta: Mapping[str, Any] | None = None) -> CachedFeatures:
        """Wrap features, measuring their size with :func:`features_nbytes`."""
        return cls(features=features, meta=dict(meta or {}), nbytes=features_nbytes(features))


def features_nbytes(obj: Any) -> int:
    """Bytes held by an array or a (nested) tuple/list/dict of arrays, from shape x dtype.

    The same sizing as KV payloads (``kv_cache.sizing.tree_nbytes``): one byte budget can be
    shared by both caches. Lazy MLX graphs are not evaluated; ``None`` counts 0.

    Raises:
        TypeError: For an object that is neither an array nor a container of arrays.
    """
    return tree_nbytes(obj)


@dataclass(frozen=True, slots=True)
class FeatureCacheStats:
    """Counters of the whole cache or of one tenant namespace.

    ``queries == hits + misses``. ``rejected`` counts items larger than the whole budget or
    refused by the tenant's quota; ``expired`` the lookups that found an entry past its time
    to live (a miss) plus entries the sweeper dropped. ``entries`` and ``resident_bytes``
    describe what is held now.
    """

    queries: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    rejected: int = 0
    expired: int = 0
    entries: int = 0
    resident_bytes: int = 0


@dataclass(slots=True)
class _Counters:
    queries: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    rejected: int = 0
    expired: int = 0
    entries: int = 0
    resident_bytes: int = 0

    def freeze(self) -> FeatureCacheStats:
        return FeatureCacheStats(**{name: getattr(self, name) for name in self.__slots__})


@dataclass(slots=True)
class _Entry:
    features: CachedFeatures
    namespace: str | None
    stored_at: float
    last_access: int
    owners: set[str] = field(default_factory=set)


class FeatureCache:
    """Bytes-budgeted LRU of :class:`CachedFeatures` keyed by :class:`FeatureKey`."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        on_evict: EvictCallback | None = None,
        clock: Callable[[], float] = time.time,
        ram: RamTier | None = None,
    ) -> None:
        """Create an empty cache.

        Args:
            budget_bytes: Most bytes of features held at once (>= 0; 0 holds nothing).
            on_evict: Called with each entry pushed out to make room (e.g. to spill it to SSD).
            clock: Wall-clock seconds for ``stored_at`` (retention survives restarts, so wall
                time, not monotonic).
            ram: The RAM tier whose tenant quotas also bound this cache (see the module
                docstring); None: no quotas.
        """
        _check_budget(budget_bytes)
        self._budget = budget_bytes
        self._on_evict = on_evict
        self._clock = clock
        self._ram = ram
        self._stamp: Callable[[], int] = ram.tick if ram is not None else itertools.count(1).__next__
        self._lock = threading.Lock()
        self._entries: OrderedDict[FeatureKey, _Entry] = OrderedDict()  # LRU first
        self._by_ns_order: dict[str | None, OrderedDict[FeatureKey, None]] = {}  # LRU first
        self._total = _Counters()
        self._by_namespace: dict[str, _Counters] = {}
        if ram is not None:
            ram.register(self, budgeted=False)

    @property
    def budget_bytes(self) -> int:
        """The byte budget."""
        return self._budget

    def get(
        self,
        key: FeatureKey,
        *,
        namespace: str | None = None,
        owner: str | None = None,
        expired_before: float | None = None,
    ) -> CachedFeatures | None:
        """Look up features and mark them most recently used.

        Args:
            key: Image hash + model fingerprint.
            namespace: Tenant namespace of the caller, counted in that tenant's stats.
            owner: Session of the caller, recorded as an owner on a hit.
            expired_before: Retention cutoff: an entry stored before it is dropped (no
                ``on_evict``) and the lookup is a miss.

        Returns:
            The features, or None on a miss.
        """
        with self._lock:
            entry = self._entries.get(key)
            expired = entry is not None and expired_before is not None and entry.stored_at < expired_before
            if expired:
                assert entry is not None
                self._pop(key)
                for counters in self._counters_for(entry.namespace):
                    counters.expired += 1
                entry = None
            hit = entry is not None
            for counters in self._counters_for(namespace):
                counters.queries += 1
                if hit:
                    counters.hits += 1
                else:
                    counters.misses += 1
            if entry is None:
                return None
            self._use(key, entry)
            if owner is not None:
                entry.owners.add(owner)
            return entry.features

    def put(
        self,
        key: FeatureKey,
        features: CachedFeatures,
        *,
        namespace: str | None = None,
        owner: str | None = None,
        stored_at: float | None = None,
    ) -> bool:
        """Store features as most recently used, evicting least recently used entries to fit.

        Replacing an existing key swaps its value (not an eviction; owners are kept). An item
        larger than the whole budget, or than room the tenant's quota can make, is not stored
        and is counted in ``rejected``.

        Args:
            key: Image hash + model fingerprint.
            features: What to store.
            namespace: Tenant namespace that owns the entry.
            owner: Session that produced (or reloaded) it.
            stored_at: When the features were computed (features read back from SSD keep
                their age); None: now.

        Returns:
            Whether the item is now stored.
        """
        if self._ram is not None and features.nbytes <= self._budget:
            # Outside the lock: making quota room may evict from this cache too.
            held = self._held_bytes(key, namespace)
            if not self._ram.make_quota_room(namespace, max(features.nbytes - held, 0)):
                with self._lock:
                    for counters in self._counters_for(namespace):
                        counters.rejected += 1
                return False
        evicted: list[tuple[FeatureKey, CachedFeatures]] = []
        with self._lock:
            if features.nbytes > self._budget:
                for counters in self._counters_for(namespace):
                    counters.rejected += 1
                return False
            old = self._pop(key)
            evicted = self._evict_until(self._budget - features.nbytes)
            entry = _Entry(
                features, namespace, self._clock() if stored_at is None else stored_at, 0,
                set(old.owners) if old is not None and old.namespace == namespace else set(),
            )
            if owner is not None:
                entry.owners.add(owner)
            self._entries[key] = entry
            self._by_ns_order.setdefault(namespace, OrderedDict())[key] = None
            entry.last_access = self._stamp()
            for counters in self._counters_for(namespace):
                counters.insertions += 1
                counters.entries += 1
                counters.resident_bytes += features.nbytes
        self._notify(evicted)
        return True

    def remove(self, key: FeatureKey) -> bool:
        """Erase one entry (no ``on_evict``). Returns whether it was present."""
        with self._lock:
            return self._pop(key) is not None

    def erase(self, keys: Iterable[FeatureKey]) -> Tally:
        """Erase entries (no ``on_evict``). Returns the entries removed and their bytes."""
        with self._lock:
            gone = [entry for key in keys if (entry := self._pop(key)) is not None]
        return Tally.of(entry.features.nbytes for entry in gone)

    def remove_namespace(self, namespace: str) -> tuple[int, int]:
        """Erase every entry a tenant stored (no ``on_evict``).

        Returns:
            (entries removed, bytes freed).
        """
        with self._lock:
            doomed = list(self._by_ns_order.get(namespace, ()))
            freed = sum(self._entries[key].features.nbytes for key in doomed)
            for key in doomed:
                self._pop(key)
            return len(doomed), freed

    def expire(self, cutoffs: Mapping[str, float]) -> Tally:
        """Drop every entry of a namespace in ``cutoffs`` stored before its cutoff (no
        ``on_evict``). Returns the entries dropped and their bytes."""
        with self._lock:
            doomed = [
                key
                for namespace, cutoff in cutoffs.items()
                for key in self._by_ns_order.get(namespace, ())
                if self._entries[key].stored_at < cutoff
            ]
            gone = [self._pop(key) for key in doomed]
            for entry in gone:
                assert entry is not None
                for counters in self._counters_for(entry.namespace):
                    counters.expired += 1
        return Tally.of(entry.features.nbytes for entry in gone if entry is not None)

    # -- owners --------------------------------------------------------------------------------

    def add_owner(self, key: FeatureKey, owner: str) -> bool:
        """Record a session as a user of an entry. Returns True when it was not one before."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or owner in entry.owners:
                return False
            entry.owners.add(owner)
            return True

    def owned_by(self, namespace: str, owner: str) -> dict[FeatureKey, frozenset[str]]:
        """Entries of a tenant that list ``owner``, with all their owners."""
        with self._lock:
            return {
                key: frozenset(entry.owners)
                for key in self._by_ns_order.get(namespace, ())
                if owner in (entry := self._entries[key]).owners
            }

    def owners(self, key: FeatureKey) -> frozenset[str] | None:
        """An entry's owners, or None when absent."""
        with self._lock:
            entry = self._entries.get(key)
            return frozenset(entry.owners) if entry is not None else None

    def discard_owner(self, key: FeatureKey, owner: str) -> None:
        """Forget ``owner`` on one entry (erasure of a session that shares it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                entry.owners.discard(owner)

    # -- quota membership (``kv_cache.tiers.ram.Evictor``) --------------------------------------

    def usage(self) -> dict[str | None, int]:
        """Resident bytes per tenant namespace."""
        with self._lock:
            return {ns: c.resident_bytes for ns, c in self._by_namespace.items() if c.resident_bytes}

    def oldest_access(self, namespace: str | None) -> int | None:
        """Access stamp of a tenant's least recently used entry, or None."""
        with self._lock:
            order = self._by_ns_order.get(namespace)
            if not order:
                return None
            return self._entries[next(iter(order))].last_access

    def evict_oldest(self, namespace: str | None) -> int:
        """Evict a tenant's least recently used entry (through ``on_evict``); returns its bytes."""
        with self._lock:
            order = self._by_ns_order.get(namespace)
            if not order:
                raise ValueError(f"no entry of namespace {namespace!r} to evict")
            key = next(iter(order))
            entry = self._pop(key)
            assert entry is not None
            for counters in self._counters_for(entry.namespace):
                counters.evictions += 1
        self._notify([(key, entry.features)])
        return entry.features.nbytes

    # -- inspection ----------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int) -> None:
        """Change the budget, evicting least recently used entries if now over it."""
        _check_budget(budget_bytes)
        with self._lock:
            self._budget = budget_bytes
            evicted = self._evict_until(budget_bytes)
        self._notify(evicted)

    def stored_at(self, key: FeatureKey) -> float | None:
        """When the entry was stored (clock seconds), or None if absent. Touches nothing."""
        with self._lock:
            entry = self._entries.get(key)
            return entry.stored_at if entry is not None else None

    def keys(self) -> tuple[FeatureKey, ...]:
        """Resident keys, least recently used first."""
        with self._lock:
            return tuple(self._entries)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        """Membership without touching LRU order or stats."""
        with self._lock:
            return key in self._entries

    def stats(self, namespace: str | None = None) -> FeatureCacheStats:
        """Counters of the whole cache, or of one tenant namespace when given."""
        with self._lock:
            if namespace is None:
                return self._total.freeze()
            counters = self._by_namespace.get(namespace)
            return counters.freeze() if counters is not None else FeatureCacheStats()

    def namespaces(self) -> tuple[str, ...]:
        """Tenant namespaces that have any counters, sorted."""
        with self._lock:
            return tuple(sorted(self._by_namespace))

    # -- internals (the caller holds the lock) ---------------------------------------------------

    def _held_bytes(self, key: FeatureKey, namespace: str | None) -> int:
        with self._lock:
            entry = self._entries.get(key)
            return entry.features.nbytes if entry is not None and entry.namespace == namespace else 0

    def _use(self, key: FeatureKey, entry: _Entry) -> None:
        self._entries.move_to_end(key)
        self._by_ns_order[entry.namespace].move_to_end(key)
        entry.last_access = self._stamp()

    def _pop(self, key: FeatureKey) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        order = self._by_ns_order[entry.namespace]
        del order[key]
        if not order:
            del self._by_ns_order[entry.namespace]
        for counters in self._counters_for(entry.namespace):
            counters.entries -= 1
            counters.resident_bytes -= entry.features.nbytes
            assert counters.entries >= 0 and counters.resident_bytes >= 0
        return entry

    def _counters_for(self, namespace: str | None) -> tuple[_Counters, ...]:
        if namespace is None:
            return (self._total,)
        counters = self._by_namespace.get(namespace)
        if counters is None:
            counters = self._by_namespace[namespace] = _Counters()
        return (self._total, counters)

    def _evict_until(self, target_bytes: int) -> list[tuple[FeatureKey, CachedFeatures]]:
        evicted: list[tuple[FeatureKey, CachedFeatures]] = []
        while self._total.resident_bytes > target_bytes:
            key = next(iter(self._entries))
            entry = self._pop(key)
            assert entry is not None
            for counters in self._counters_for(entry.namespace):
                counters.evictions += 1
            evicted.append((key, entry.features))
        return evicted

    def _notify(self, evicted: list[tuple[FeatureKey, CachedFeatures]]) -> None:
        if self._on_evict is None:
            return
        for key, features in evicted:
            self._on_evict(key, features)


def _check_budget(budget_bytes: int) -> None:
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
