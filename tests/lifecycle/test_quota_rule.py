"""The per-tenant share rule and its enforcement in the RAM tier: a tenant over its quota gives
back its own least recently used blocks (and vision features); shared eviction takes only from
the requester and from tenants above their guarantee."""

from __future__ import annotations

import pytest

from kv_cache.tiers.quota import eviction_candidates, guarantees
from tests.kv_cache.factories import Blob
from tests.lifecycle.factories import NS_A, NS_B, NS_C, cache, feature_key, features, labels, put
from vision_cache.feature_cache import FeatureCache


def test_guarantees_are_quotas_until_overcommitted_then_proportional() -> None:
    assert guarantees(100, {"a": 30, "b": 40}, ["a", "b", "c"]) == {"a": 30, "b": 40, "c": 0}
    # 80 + 80 > 100: each gets 80 * 100 // 160 = 50; absent tenants do not count.
    assert guarantees(100, {"a": 80, "b": 80, "z": 500}, ["a", "b"]) == {"a": 50, "b": 50}
    # Floors keep the sum within the budget.
    assert guarantees(10, {"a": 7, "b": 7, "c": 7}, ["a", "b", "c"]) == {"a": 3, "b": 3, "c": 3}


def test_eviction_candidates_are_the_requester_and_tenants_above_their_guarantee() -> None:
    quotas = {"a": 80, "b": 80}
    assert eviction_candidates(100, quotas, {"a": 40, "b": 60}, "a") == {"a", "b"}
    assert eviction_candidates(100, quotas, {"a": 50, "b": 50}, "a") == {"a"}
    # No quota, no guarantee: plain LRU among everyone holding bytes.
    assert eviction_candidates(100, {}, {"a": 10, "b": 10, None: 5}, "c") == {"a", "b", None, "c"}


def test_tenant_over_its_quota_evicts_its_own_oldest_blocks_first() -> None:
    spilled = []
    c = cache(100, spilled)
    c.ram.set_quota(NS_A, 30)
    c.ram.set_quota(NS_B, 40)
    for i in range(4):
        put(c, NS_B, f"b{i}", first=100 + 10 * i)
    for i in range(6):
        put(c, NS_A, f"a{i}", first=10 * i)
    assert labels(spilled) == ["a0", "a1", "a2"]
    assert labels(c.pool.free_blocks_of(NS_A)) == ["a3", "a4", "a5"]
    assert labels(c.pool.free_blocks_of(NS_B)) == ["b0", "b1", "b2", "b3"]
    assert (c.ram.usage_of(NS_A), c.ram.usage_of(NS_B), c.ram.used_bytes) == (30, 40, 70)
    assert (c.ram.stats.quota_evictions, c.ram.stats.evictions) == (3, 3)


def test_flooding_without_quota_cannot_push_a_guaranteed_tenant_below_its_share() -> None:
    spilled = []
    c = cache(100, spilled)
    c.ram.set_quota(NS_B, 40)
    put(c, NS_C, "c0", first=200)  # oldest of all, no quota: no guarantee
    put(c, NS_C, "c1", first=210)
    for i in range(4):
        put(c, NS_B, f"b{i}", first=100 + 10 * i)
    for i in range(7):
        put(c, NS_A, f"a{i}", first=10 * i)
    # B's blocks are older than every block of A, yet A (no quota) takes from C and from itself.
    assert labels(spilled) == ["c0", "c1", "a0"]
    assert labels(c.pool.free_blocks()) == ["b0", "b1", "b2", "b3", "a1", "a2", "a3", "a4", "a5", "a6"]


def test_overcommitted_quotas_are_guaranteed_proportionally() -> None:
    spilled = []
    c = cache(100, spilled)
    c.ram.set_quota(NS_A, 80)
    c.ram.set_quota(NS_B, 80)  # 160 > 100: each is guaranteed 50
    for i in range(6):
        put(c, NS_B, f"b{i}", first=100 + 10 * i)  # 60: above B's guarantee
    for i in range(6):
        put(c, NS_A, f"a{i}", first=10 * i)
    # a4 takes B's oldest (B above its 50), a5 its own oldest (B is at 50 now).
    assert labels(spilled) == ["b0", "a0"]
    assert (c.ram.usage_of(NS_A), c.ram.usage_of(NS_B)) == (50, 50)


def test_pinned_blocks_over_quota_refuse_the_insert() -> None:
    spilled = []
    c = cache(100, spilled)
    c.ram.set_quota(NS_A, 20)
    pinned = [put(c, NS_A, "a0", first=0), put(c, NS_A, "a1", first=10)]
    c.acquire(pinned)
    assert c.insert_block(pinned[0].parent, [50, 51, 52, 53], (), Blob(10, "a2"),
                          partial=False, namespace=NS_A) is None
    assert labels(spilled) == ["a2"]  # refused: handed to the lower tier, not stored
    assert (c.ram.stats.quota_refusals, c.stats.rejected) == (1, 1)
    c.release(pinned)


def test_lowering_a_quota_evicts_down_to_it() -> None:
    spilled = []
    c = cache(100, spilled)
    for i in range(5):
        put(c, NS_A, f"a{i}", first=10 * i)
    assert c.ram.set_quota(NS_A, 25)
    assert labels(spilled) == ["a0", "a1", "a2"]
    assert c.ram.quota(NS_A) == 25 and c.ram.usage_of(NS_A) == 20
    with pytest.raises(ValueError, match=">= 0"):
        c.ram.set_quota(NS_A, -1)


def test_vision_features_count_toward_the_same_quota_oldest_first_across_caches() -> None:
    spilled = []
    c = cache(1000, spilled)
    evicted = []
    feats = FeatureCache(1000, ram=c.ram, on_evict=lambda key, f: evicted.append(key))
    c.ram.set_quota(NS_A, 30)
    put(c, NS_A, "kv0", first=0)  # 10
    assert feats.put(feature_key(1), features(15), namespace=NS_A)  # 25
    put(c, NS_A, "kv1", first=10)  # 35 > 30: the oldest of A in either cache (kv0) goes
    assert labels(spilled) == ["kv0"] and evicted == []
    assert feats.put(feature_key(2), features(15), namespace=NS_A)  # 40 > 30: feature 1 goes
    assert evicted == [feature_key(1)]
    assert feats.keys() == (feature_key(2),)
    assert c.ram.usage_of(NS_A) == 25
    # Features larger than the quota are refused without evicting anything.
    assert not feats.put(feature_key(3), features(31), namespace=NS_A)
    assert feats.stats(NS_A).rejected == 1 and c.ram.usage_of(NS_A) == 25
