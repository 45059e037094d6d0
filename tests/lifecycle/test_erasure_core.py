"""Session erasure in the cores: what a session alone owns goes from every tier, what it shares
stays with the other owners listed on every copy; the reply ledger forgets its replies."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from kv_cache.erasure import erase_owner
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tally import Tally
from kv_cache.tiers.ram import RamTier
from kv_cache.tiers.ssd_index import RecordKind
from kv_cache.tiers.ssd_maintenance import split_owned
from server.engine.prompt import ReplyLedger
from tests.ssd.factories import FINGERPRINT, NAMESPACE, ROOT, block_files, open_tier, payload
from vision_cache.erasure import erase_feature_owner
from vision_cache.feature_cache import CachedFeatures, FeatureCache, FeatureKey
from vision_cache.hashing import ImageHash
from vision_cache.ssd import FeatureCodec, FeatureSsd

OTHER_NS = "nsotherxxxxxxxxx"


def test_split_owned_unions_the_owners_of_every_copy() -> None:
    doomed, shared = split_owned("s", [("k1", {"s"}), ("k2", {"s", "t"}), ("k3", {"s"}), ("k3", {"u"}),
                                       ("k4", set())])
    assert doomed == {"k1", "k4"}
    assert shared == {"k2": frozenset({"t"}), "k3": frozenset({"u"})}


def test_erasing_a_session_removes_its_private_blocks_from_ram_and_ssd(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    cache = PrefixCache(4, RamTier(1 << 20), on_evict=tier.spill)

    def insert(parent, tokens, seed, owner, namespace=NAMESPACE):
        b = cache.insert_block(parent, tokens, (), payload(seed), owner, partial=False, namespace=namespace)
        assert b is not None
        return b

    shared = insert(ROOT, [0, 1, 2, 3], 0, "T")
    cache.pool.add_owner(shared, "S")  # S reused T's system prompt
    s1 = insert(shared.block_hash, [4, 5, 6, 7], 1, "S")
    s2 = insert(s1.block_hash, [8, 9, 10, 11], 2, "S")
    t1 = insert(shared.block_hash, [20, 21, 22, 23], 3, "T")
    other = insert(ROOT, [40, 41, 42, 43], 4, "S", namespace=OTHER_NS)  # session S of another tenant
    for b in (shared, s1, s2, t1, other):
        assert tier.spill(b, wait=True)
    tier.flush()
    tier.set_owners(RecordKind.KV, bytes(shared.block_hash), ["S"])  # a copy that missed T
    cache.discard(s2)  # s2 is only on SSD now
    s2_size = tier.rows_of(RecordKind.KV, [bytes(s2.block_hash)])[bytes(s2.block_hash)].size
    s1_size = tier.rows_of(RecordKind.KV, [bytes(s1.block_hash)])[bytes(s1.block_hash)].size

    report = erase_owner(cache, tier, NAMESPACE, "S")

    assert report.ram == Tally(1, s1.nbytes)
    assert report.ssd == Tally(2, s1_size + s2_size)
    assert report.kept_shared == 1
    assert [b.block_hash for b in cache.pool if b.namespace == NAMESPACE] == [shared.block_hash, t1.block_hash]
    assert shared.owners == {"T"} and other.owners == {"S"}
    rows = {r.key: r.owners for r in tier.rows(RecordKind.KV)}
    assert rows == {bytes(shared.block_hash): ("T",), bytes(t1.block_hash): ("T",),
                    bytes(other.block_hash): ("S",)}
    names = {p.name.split(".")[0] for p in block_files(tmp_path)}
    assert names == {shared.block_hash.hex(), t1.block_hash.hex(), other.block_hash.hex()}
    tier.close()


def test_erasing_a_session_removes_features_only_it_used(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, codecs=(FeatureCodec(FINGERPRINT),))
    ssd = FeatureSsd(tier, FINGERPRINT)
    feats = FeatureCache(1 << 20)

    def key(i: int) -> FeatureKey:
        return FeatureKey(ImageHash(bytes([i]) * 16), FINGERPRINT)

    def stored() -> CachedFeatures:
        f = CachedFeatures.of(mx.ones((4, 8)), {"num_tokens": 4})
        mx.eval(f.features)
        return f

    for i, owner in ((1, "S"), (2, "S"), (3, "S"), (4, "T")):
        f = stored()
        feats.put(key(i), f, namespace=NAMESPACE, owner=owner, stored_at=100.0)
        ssd.store(key(i), f, NAMESPACE, owner=owner, stored_at=100.0)
    tier.flush()
    feats.add_owner(key(2), "T")  # T reused image 2 while it was in RAM (its row lacks T)
    feats.remove(key(3))  # image 3 is only on SSD now
    size = {r.key: r.size for r in tier.rows(RecordKind.VISION)}

    report = erase_feature_owner(feats, ssd, NAMESPACE, "S")

    assert report.ram == Tally(1, 128)
    assert report.ssd == Tally(2, size[bytes(key(1).image_hash)] + size[bytes(key(3).image_hash)])
    assert report.kept_shared == 1
    assert feats.keys() == (key(2), key(4))
    assert feats.owners(key(2)) == {"T"}
    assert {r.key: r.owners for r in tier.rows(RecordKind.VISION)} == {
        bytes(key(2).image_hash): ("T",), bytes(key(4).image_hash): ("T",)}
    tier.close()


def test_reply_ledger_forgets_a_session_and_a_tenant() -> None:
    ledger = ReplyLedger()
    ledger.record("ns-a", "only s", [1], "s")
    ledger.record("ns-a", "s and t", [2], "s")
    ledger.record("ns-a", "s and t", [2], "t")
    ledger.record("ns-a", "s and anonymous", [3], "s")
    ledger.record("ns-a", "s and anonymous", [3])
    ledger.record("ns-b", "only s", [4], "s")
    assert ledger.forget_session("ns-a", "s") == 1
    assert ledger.get("ns-a", "only s") is None
    assert [ledger.get("ns-a", t) for t in ("s and t", "s and anonymous")] == [(2,), (3,)]
    assert ledger.get("ns-b", "only s") == (4,)
    assert ledger.forget_namespace("ns-a") == 2
    assert len(ledger) == 1


def test_blocks_still_queued_for_writing_do_not_land_after_the_erasure(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    cache = PrefixCache(4, RamTier(1 << 30), on_evict=tier.spill)
    parent, blocks = ROOT, []
    for i in range(12):
        b = cache.insert_block(parent, [4 * i + k for k in range(4)], (), payload(i, length=256), "S",
                               partial=False, namespace=NAMESPACE)
        blocks.append(b)
        parent = b.block_hash
    for b in blocks:
        cache.discard(b)  # gone from RAM...
        assert tier.spill(b)  # ...and queued: the writer is still busy with the first ones
    report = erase_owner(cache, tier, NAMESPACE, "S")
    assert report.ssd.count == 12 and report.ram == Tally()
    tier.flush()
    assert tier.rows(RecordKind.KV) == [] and block_files(tmp_path) == []
    assert tier.stats().queued == 0
    tier.close()
