"""Time to live in the cores: an expired block or feature is never served (even before a
sweep) and is reported as expired; sweeps drop everything past the cutoff, per namespace."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from kv_cache import retention
from kv_cache.hashing import CACHE_FORMAT_VERSION, BlockHash, root_hash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tally import Tally
from kv_cache.tiered import TieredPrefixCache
from kv_cache.tiers.ram import RamTier
from kv_cache.tiers.ssd_index import RecordKind
from tests.kv_cache.factories import ROOT as RAM_ROOT
from tests.kv_cache.factories import Blob, toks
from tests.lifecycle.factories import BLOCK, NS_A, NS_B, Clock, cache, feature_key, features
from tests.ssd.factories import FINGERPRINT, NAMESPACE, ROOT, STORED_AT, chain, open_tier
from vision_cache.feature_cache import CachedFeatures, FeatureCache, FeatureKey
from vision_cache.ssd import FeatureCodec, FeatureSsd


ROOT_B = root_hash(CACHE_FORMAT_VERSION, "test-model", b"other-tenant-salt")


def store(c: PrefixCache, text: str, namespace: str, label: str, root: BlockHash = RAM_ROOT) -> list:
    tokens = toks(text)
    payloads = [Blob(10, f"{label}{i}") for i in range(len(tokens) // BLOCK)]
    return c.store(root, tokens, (), payloads, None, "s1", namespace)


def test_expired_ram_blocks_are_misses_dropped_before_the_walk() -> None:
    clock = Clock(1000.0)
    c = cache(1000, clock=clock)
    x = store(c, "A B C D E F G H I J K L", NS_A, "x")  # stored at 1000
    clock.now = 1100.0
    y = store(c, "M N O P Q R S T", NS_A, "y")  # stored at 1100
    expired: list[BlockHash] = []
    tiered = TieredPrefixCache(c, None, needs_checkpoint=False, on_expired=expired.append)
    hit = tiered.lookup(RAM_ROOT, toks("A B C D E F G H I J K L Z"), (), NS_A, expired_before=1050.0)
    assert (hit.blocks, hit.hit_tokens) == ((), 0)
    assert expired == [b.block_hash for b in x]  # root's child first, then down the chain
    assert [b.resident for b in x] == [False, False, False]
    assert (c.stats.expired, tiered.stats.expired_ram, c.ram.used_bytes) == (3, 3, 20)
    # Younger state of the same tenant still hits; without a cutoff nothing is judged.
    assert tiered.lookup(RAM_ROOT, toks("M N O P Q R S T Z"), (), NS_A, expired_before=1050.0).blocks == tuple(y)


def test_sweep_expires_each_namespace_by_its_own_cutoff() -> None:
    clock = Clock(1000.0)
    c = cache(1000, clock=clock)
    a_old = store(c, "A B C D", NS_A, "a")
    b_old = store(c, "A B C D", NS_B, "b", root=ROOT_B)  # same tokens, other tenant
    clock.now = 2000.0
    a_new = store(c, "E F G H", NS_A, "n")
    expired: list[BlockHash] = []
    assert retention.sweep(c, {NS_A: 1500.0}, expired.append) == Tally(1, 10)
    assert expired == [a_old[0].block_hash]
    assert [a_old[0].resident, b_old[0].resident, a_new[0].resident] == [False, True, True]
    assert retention.sweep(c, {}, expired.append) == Tally()
    assert retention.sweep(c, {NS_B: 2500.0}) == Tally(1, 10)
    assert not b_old[0].resident and a_new[0].resident


def test_expired_ssd_blocks_are_misses_and_deleted_on_read(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    ram = PrefixCache(4, RamTier(1 << 20), on_evict=tier.spill)
    blocks = chain(3)  # stored at STORED_AT + 0, 1, 2
    for b in blocks:
        assert tier.spill(b)
    tier.flush()
    expired: list[BlockHash] = []
    tiered = TieredPrefixCache(ram, tier, needs_checkpoint=False, on_expired=expired.append)
    tokens = list(range(13))
    hit = tiered.lookup(ROOT, tokens, (), NAMESPACE, expired_before=STORED_AT + 0.5)
    assert hit.hit_tokens == 0 and tiered.stats.promotions == 0
    assert expired == [blocks[0].block_hash]  # the walk stops at the first expired block
    assert sorted(r.key for r in tier.rows(RecordKind.KV)) == sorted(bytes(b.block_hash) for b in blocks[1:])
    # Without a cutoff the younger blocks are still on disk, but the chain is cut at block 0.
    assert tiered.lookup(ROOT, tokens, (), NAMESPACE).hit_tokens == 0
    tier.close()


def test_promoted_blocks_keep_their_age(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    ram = PrefixCache(4, RamTier(1 << 20), on_evict=tier.spill, clock=Clock(5e9))
    blocks = chain(2)
    for b in blocks:
        tier.spill(b)
    tier.flush()
    tiered = TieredPrefixCache(ram, tier, needs_checkpoint=False)
    hit = tiered.lookup(ROOT, list(range(9)), (), NAMESPACE)
    assert [b.stored_at for b in hit.blocks] == [STORED_AT, STORED_AT + 1]  # not the clock's 5e9
    tier.close()


def test_expired_features_are_misses_and_swept() -> None:
    clock = Clock(1000.0)
    feats = FeatureCache(1000, clock=clock)
    feats.put(feature_key(1), features(10), namespace=NS_A)
    clock.now = 2000.0
    feats.put(feature_key(2), features(20), namespace=NS_A)
    feats.put(feature_key(3), features(30), namespace=NS_B)
    assert feats.get(feature_key(1), namespace=NS_A, expired_before=1500.0) is None
    assert feature_key(1) not in feats
    stats = feats.stats(NS_A)
    assert (stats.queries, stats.misses, stats.expired, stats.entries) == (1, 1, 1, 1)
    clock.now = 3000.0
    assert feats.expire({NS_A: 2500.0}) == Tally(1, 20)
    assert feats.keys() == (feature_key(3),)


def test_expired_features_on_ssd_are_misses_and_deleted(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, codecs=(FeatureCodec(FINGERPRINT),))
    ssd = FeatureSsd(tier, FINGERPRINT)
    key = FeatureKey(feature_key(7).image_hash, FINGERPRINT)
    stored = CachedFeatures.of(mx.ones((4, 8)), {"num_tokens": 4})
    mx.eval(stored.features)
    assert ssd.store(key, stored, NAMESPACE, owner="s1", stored_at=500.0)
    tier.flush()
    assert ssd.load(key, NAMESPACE, expired_before=400.0).stored_at == 500.0
    assert ssd.load(key, NAMESPACE, expired_before=600.0) is None
    assert tier.rows(RecordKind.VISION) == []
    tier.close()
