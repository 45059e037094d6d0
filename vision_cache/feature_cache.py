"""RAM cache of vision-encoder outputs: a bytes-budgeted LRU keyed by (image hash, model).

Image hashes are tenant-salted, so entries of different tenants never share a key; each entry
also records the namespace of the tenant that stored it, for per-tenant stats now and per-tenant
quotas, retention and erasure later (``stored_at`` is kept for retention).

Eviction (to make room) calls ``on_evict(key, features)`` so a later SSD tier can spill the
entry. Explicit removal (:meth:`FeatureCache.remove`, :meth:`FeatureCache.remove_namespace`) is
erasure and never calls it: erased data must not reappear in another tier.

Thread-safe: the engine thread reads and writes, HTTP threads read stats. ``on_evict`` runs
after the lock is released, so it may call back into the cache.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kv_cache.sizing import tree_nbytes
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

    ``queries == hits + misses``. ``rejected`` counts items larger than the whole budget.
    ``entries`` and ``resident_bytes`` describe what is held now.
    """

    queries: int = 0
    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    rejected: int = 0
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
    entries: int = 0
    resident_bytes: int = 0

    def freeze(self) -> FeatureCacheStats:
        return FeatureCacheStats(
            queries=self.queries,
            hits=self.hits,
            misses=self.misses,
            insertions=self.insertions,
            evictions=self.evictions,
            rejected=self.rejected,
            entries=self.entries,
            resident_bytes=self.resident_bytes,
        )


@dataclass(slots=True)
class _Entry:
    features: CachedFeatures
    namespace: str | None
    stored_at: float


class FeatureCache:
    """Bytes-budgeted LRU of :class:`CachedFeatures` keyed by :class:`FeatureKey`."""

    def __init__(
        self,
        budget_bytes: int,
        *,
        on_evict: EvictCallback | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Create an empty cache.

        Args:
            budget_bytes: Most bytes of features held at once (>= 0; 0 holds nothing).
            on_evict: Called with each entry pushed out to make room (e.g. to spill it to SSD).
            clock: Wall-clock seconds for ``stored_at`` (retention survives restarts, so wall
                time, not monotonic).
        """
        _check_budget(budget_bytes)
        self._budget = budget_bytes
        self._on_evict = on_evict
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[FeatureKey, _Entry] = OrderedDict()  # LRU first
        self._total = _Counters()
        self._by_namespace: dict[str, _Counters] = {}

    @property
    def budget_bytes(self) -> int:
        """The byte budget."""
        return self._budget

    def get(self, key: FeatureKey, *, namespace: str | None = None) -> CachedFeatures | None:
        """Look up features and mark them most recently used.

        Args:
            key: Image hash + model fingerprint.
            namespace: Tenant namespace of the caller, counted in that tenant's stats.

        Returns:
            The features, or None on a miss.
        """
        with self._lock:
            entry = self._entries.get(key)
            hit = entry is not None
            for counters in self._counters_for(namespace):
                counters.queries += 1
                if hit:
                    counters.hits += 1
                else:
                    counters.misses += 1
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.features

    def put(self, key: FeatureKey, features: CachedFeatures, *, namespace: str | None = None) -> bool:
        """Store features as most recently used, evicting least recently used entries to fit.

        Replacing an existing key swaps its value (not an eviction). An item larger than the
        whole budget is not stored and is counted in ``rejected``.

        Args:
            key: Image hash + model fingerprint.
            features: What to store.
            namespace: Tenant namespace that owns the entry.

        Returns:
            Whether the item is now stored.
        """
        evicted: list[tuple[FeatureKey, CachedFeatures]] = []
        with self._lock:
            if features.nbytes > self._budget:
                for counters in self._counters_for(namespace):
                    counters.rejected += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._account_removal(old)
            evicted = self._evict_until(self._budget - features.nbytes)
            self._entries[key] = _Entry(features, namespace, self._clock())
            for counters in self._counters_for(namespace):
                counters.insertions += 1
                counters.entries += 1
                counters.resident_bytes += features.nbytes
        self._notify(evicted)
        return True

    def remove(self, key: FeatureKey) -> bool:
        """Erase one entry (no ``on_evict``). Returns whether it was present."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._account_removal(entry)
            return True

    def remove_namespace(self, namespace: str) -> tuple[int, int]:
        """Erase every entry a tenant stored (no ``on_evict``).

        Returns:
            (entries removed, bytes freed).
        """
        with self._lock:
            doomed = [k for k, e in self._entries.items() if e.namespace == namespace]
            freed = 0
            for k in doomed:
                entry = self._entries.pop(k)
                freed += entry.features.nbytes
                self._account_removal(entry)
            return len(doomed), freed

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

    def _counters_for(self, namespace: str | None) -> tuple[_Counters, ...]:
        if namespace is None:
            return (self._total,)
        counters = self._by_namespace.get(namespace)
        if counters is None:
            counters = self._by_namespace[namespace] = _Counters()
        return (self._total, counters)

    def _account_removal(self, entry: _Entry) -> None:
        for counters in self._counters_for(entry.namespace):
            counters.entries -= 1
            counters.resident_bytes -= entry.features.nbytes
            assert counters.entries >= 0 and counters.resident_bytes >= 0

    def _evict_until(self, target_bytes: int) -> list[tuple[FeatureKey, CachedFeatures]]:
        evicted: list[tuple[FeatureKey, CachedFeatures]] = []
        while self._total.resident_bytes > target_bytes:
            key, entry = self._entries.popitem(last=False)
            self._account_removal(entry)
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
