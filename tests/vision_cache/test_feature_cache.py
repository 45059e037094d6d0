from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vision_cache.feature_cache import (
    CachedFeatures,
    FeatureCache,
    FeatureCacheStats,
    FeatureKey,
    features_nbytes,
)
from vision_cache.hashing import ImageHash

MODEL = "fp-test"


def _key(n: int, model: str = MODEL) -> FeatureKey:
    return FeatureKey(ImageHash(bytes([n]) * 16), model)


def _feats(nbytes: int, tag: int = 0) -> CachedFeatures:
    return CachedFeatures(features=("feats", tag), meta={"num_tokens": tag}, nbytes=nbytes)


def test_features_nbytes_from_shape_and_dtype() -> None:
    lazy = mx.ones((4, 8), dtype=mx.float16) * 3  # not evaluated
    assert features_nbytes(lazy) == 4 * 8 * 2
    assert features_nbytes(mx.zeros((2, 3, 5), dtype=mx.float32)) == 120
    assert features_nbytes(np.zeros((10, 3), dtype=np.uint8)) == 30
    assert features_nbytes((lazy, [np.zeros(4, dtype=np.float64)], {"x": mx.zeros((1,), dtype=mx.bfloat16)}, None)) == 64 + 32 + 2
    with pytest.raises(TypeError, match="expected an array with shape and dtype, got str"):
        features_nbytes("nope")


def test_cached_features_of() -> None:
    arr = mx.zeros((16, 32), dtype=mx.bfloat16)
    cached = CachedFeatures.of(arr, {"grid_thw": (1, 4, 4), "num_tokens": 16})
    assert cached.nbytes == 16 * 32 * 2
    assert cached.meta == {"grid_thw": (1, 4, 4), "num_tokens": 16}
    assert cached.features is arr
    with pytest.raises(ValueError, match="nbytes must be an integer >= 0, got -1"):
        CachedFeatures(features=None, meta={}, nbytes=-1)


def test_get_miss_then_hit() -> None:
    cache = FeatureCache(100)
    assert cache.get(_key(1)) is None
    feats = _feats(10, 1)
    assert cache.put(_key(1), feats) is True
    assert cache.get(_key(1)) is feats
    # Same image hash, other model: a different entry.
    assert cache.get(_key(1, "other-model")) is None
    assert cache.stats() == FeatureCacheStats(
        queries=3, hits=1, misses=2, insertions=1, evictions=0, rejected=0, entries=1, resident_bytes=10
    )


def test_exact_lru_eviction_order_under_byte_budget() -> None:
    evicted: list[FeatureKey] = []
    cache = FeatureCache(100, on_evict=lambda key, feats: evicted.append(key))
    for n, size in [(1, 30), (2, 30), (3, 30)]:
        cache.put(_key(n), _feats(size, n))
    assert cache.keys() == (_key(1), _key(2), _key(3))
    cache.get(_key(1))  # 1 becomes most recent: order 2, 3, 1
    assert cache.keys() == (_key(2), _key(3), _key(1))
    cache.put(_key(4), _feats(25, 4))  # 90 + 25 > 100: evicts 2 only
    assert evicted == [_key(2)]
    assert cache.keys() == (_key(3), _key(1), _key(4))
    cache.put(_key(5), _feats(70, 5))  # 85 + 70: evicts 3, 1 (then 25 + 70 = 95 fits)
    assert evicted == [_key(2), _key(3), _key(1)]
    assert cache.keys() == (_key(4), _key(5))
    assert cache.stats().resident_bytes == 95
    assert cache.stats().evictions == 3


def test_item_exactly_the_budget_fits() -> None:
    cache = FeatureCache(50)
    cache.put(_key(1), _feats(20))
    assert cache.put(_key(2), _feats(50)) is True
    assert cache.keys() == (_key(2),)
    assert cache.stats().resident_bytes == 50


def test_oversize_item_rejected_and_counted() -> None:
    evicted: list[FeatureKey] = []
    cache = FeatureCache(50, on_evict=lambda key, feats: evicted.append(key))
    cache.put(_key(1), _feats(20))
    assert cache.put(_key(2), _feats(51), namespace="ns-a") is False
    assert cache.keys() == (_key(1),)  # nothing evicted for it
    assert evicted == []
    assert _key(2) not in cache
    assert cache.stats().rejected == 1
    assert cache.stats("ns-a").rejected == 1
    assert cache.stats().insertions == 1


def test_replace_existing_key_is_not_an_eviction() -> None:
    evicted: list[FeatureKey] = []
    cache = FeatureCache(100, on_evict=lambda key, feats: evicted.append(key))
    cache.put(_key(1), _feats(40, 1))
    cache.put(_key(2), _feats(40, 2))
    replacement = _feats(60, 9)
    cache.put(_key(1), replacement)  # 40 (key 2) + 60 = 100 fits once the old value is gone
    assert evicted == []
    assert cache.keys() == (_key(2), _key(1))
    assert cache.get(_key(1)) is replacement
    assert cache.stats().resident_bytes == 100
    assert cache.stats().entries == 2


def test_per_tenant_stats() -> None:
    cache = FeatureCache(100)
    cache.put(_key(1), _feats(30), namespace="ns-a")
    cache.put(_key(2), _feats(30), namespace="ns-b")
    cache.get(_key(1), namespace="ns-a")
    cache.get(_key(2), namespace="ns-a")  # counted for the caller, whoever stored it
    cache.get(_key(9), namespace="ns-b")
    cache.put(_key(3), _feats(50), namespace="ns-b")  # evicts key 1 (ns-a)
    assert cache.stats("ns-a") == FeatureCacheStats(
        queries=2, hits=2, misses=0, insertions=1, evictions=1, rejected=0, entries=0, resident_bytes=0
    )
    assert cache.stats("ns-b") == FeatureCacheStats(
        queries=1, hits=0, misses=1, insertions=2, evictions=0, rejected=0, entries=2, resident_bytes=80
    )
    assert cache.stats() == FeatureCacheStats(
        queries=3, hits=2, misses=1, insertions=3, evictions=1, rejected=0, entries=2, resident_bytes=80
    )
    assert cache.stats("ns-unknown") == FeatureCacheStats()
    assert cache.namespaces() == ("ns-a", "ns-b")


def test_remove_and_remove_namespace_do_not_spill() -> None:
    evicted: list[FeatureKey] = []
    cache = FeatureCache(100, on_evict=lambda key, feats: evicted.append(key))
    cache.put(_key(1), _feats(10), namespace="ns-a")
    cache.put(_key(2), _feats(20), namespace="ns-b")
    cache.put(_key(3), _feats(30), namespace="ns-a")
    assert cache.remove_namespace("ns-a") == (2, 40)
    assert cache.keys() == (_key(2),)
    assert cache.remove(_key(2)) is True
    assert cache.remove(_key(2)) is False
    assert evicted == []
    assert len(cache) == 0
    assert cache.stats().resident_bytes == 0
    assert cache.stats("ns-a").entries == 0


def test_set_budget_evicts_lru() -> None:
    evicted: list[FeatureKey] = []
    cache = FeatureCache(100, on_evict=lambda key, feats: evicted.append(key))
    for n in (1, 2, 3):
        cache.put(_key(n), _feats(30))
    cache.set_budget(40)
    assert evicted == [_key(1), _key(2)]
    assert cache.keys() == (_key(3),)
    assert cache.budget_bytes == 40


def test_on_evict_may_reenter_cache() -> None:
    cache: FeatureCache
    seen: list[int] = []

    def spill(key: FeatureKey, feats: CachedFeatures) -> None:
        seen.append(len(cache))  # would deadlock if called under the lock

    cache = FeatureCache(10, on_evict=spill)
    cache.put(_key(1), _feats(10))
    cache.put(_key(2), _feats(10))
    assert seen == [1]


def test_zero_budget_and_bad_budget() -> None:
    cache = FeatureCache(0)
    assert cache.put(_key(1), _feats(1)) is False
    assert cache.put(_key(2), _feats(0)) is True
    with pytest.raises(ValueError, match="budget_bytes must be an integer >= 0, got -1"):
        FeatureCache(-1)


def test_stored_at_uses_injected_clock() -> None:
    now = [1000.0]
    cache = FeatureCache(100, clock=lambda: now[0])
    cache.put(_key(1), _feats(1))
    now[0] = 2000.0
    cache.put(_key(2), _feats(1))
    assert [cache.stored_at(k) for k in cache.keys()] == [1000.0, 2000.0]
    assert cache.stored_at(_key(3)) is None
