"""Lookups across RAM and SSD: the walk continues in the index, promotion stays within the RAM
budget, bad files degrade to shorter hits, recurrent models get a checkpointed length."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_cache.hashing import BlockHash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tiered import TieredPrefixCache
from kv_cache.tiers.ram import RamTier
from kv_cache.tiers.ssd_index import RecordKind
from tests.ssd.factories import NAMESPACE, ROOT, open_tier, payload, same_payload

B = 4


class Setup:
    def __init__(self, cache_dir: Path, budget_blocks: int, needs_checkpoint: bool = False) -> None:
        self.per_block = payload(0, B).nbytes
        self.ssd = open_tier(cache_dir)
        self.ram = RamTier(budget_blocks * self.per_block)
        self.cache = PrefixCache(B, self.ram, on_evict=self.ssd.spill)
        self.tiered = TieredPrefixCache(self.cache, self.ssd, needs_checkpoint=needs_checkpoint)
        self.payloads: dict[BlockHash, object] = {}

    def store(self, tokens: list[int], seed: int, partial_checkpoint: bool = False, checkpoints=()):
        full = len(tokens) // B
        payloads = [payload(seed + i, B, checkpoint=i in checkpoints) for i in range(full)]
        rest = len(tokens) % B
        tail = payload(seed + 100, rest, checkpoint=partial_checkpoint) if rest else None
        blocks = self.cache.store(ROOT, tokens, (), payloads, tail, owner="s1", namespace=NAMESPACE)
        for b in blocks:
            self.payloads[b.block_hash] = b.payload
        return blocks

    def lookup(self, tokens: list[int], namespace: str = NAMESPACE):
        hit = self.tiered.lookup(ROOT, tokens, (), namespace)
        assert self.ram.used_bytes <= self.ram.budget_bytes
        return hit


A = list(range(100, 124))  # 6 blocks
C = list(range(200, 224))  # 6 other blocks


def test_evicted_chain_is_promoted_back_whole(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=8)
    stored_a = s.store(A, 0)
    s.store(C, 50)  # evicts A's blocks (leaves first) to SSD
    s.ssd.flush()
    assert s.cache.stats.evictions == 4
    assert sum(1 for b in stored_a if not b.resident) == 4
    hit = s.lookup(A + [1])
    assert [b.block_hash for b in hit.blocks] == [b.block_hash for b in stored_a]
    assert hit.hit_tokens == 24
    for original, now in zip(stored_a, hit.blocks):
        assert same_payload(now.payload, original.payload)
        assert now.namespace == NAMESPACE and now.owners == {"s1"}
    stats = s.tiered.stats
    assert (stats.ssd_lookups, stats.hits, stats.promotions, stats.hit_blocks) == (1, 1, 4, 4)
    assert stats.promoted_bytes == 4 * s.per_block
    s.ssd.close()


def test_chain_longer_than_ram_uses_the_prefix_that_fits(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=3)
    stored = s.store(A, 0)  # blocks 0..2 evicted (leaves age first), 3..5 stay, detached
    s.ssd.flush()
    assert [b.tokens[0] for b in stored] == [112, 116, 120]
    hit = s.lookup(A + [1])
    assert [b.tokens[0] for b in hit.blocks] == [100, 104, 108]
    assert (s.tiered.stats.promotions, s.tiered.stats.budget_refusals) == (3, 0)
    assert s.ram.used_bytes == 3 * s.per_block
    s.ssd.close()


def test_promotion_stops_where_ram_cannot_make_room(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=8)
    s.store(A, 0)
    in_use = s.store(C, 50)  # A's blocks 2..5 go to SSD
    s.cache.acquire(in_use)  # another request is using all of C
    s.ssd.flush()
    hit = s.lookup(A + [1])
    assert hit.hit_tokens == 8  # A's resident blocks 0, 1; block 2 finds no room
    assert (s.tiered.stats.budget_refusals, s.tiered.stats.promotions) == (1, 0)
    assert s.ram.used_bytes == 8 * s.per_block
    s.cache.release(in_use)
    s.ssd.close()


def test_corrupt_file_cuts_the_hit_and_is_quarantined(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=8)
    stored = s.store(A, 0)
    s.store(C, 50)
    s.ssd.flush()
    victim = stored[4]
    path = s.ssd.layout.path(RecordKind.KV, NAMESPACE, victim.block_hash)
    path.write_bytes(path.read_bytes()[:-7])
    hit = s.lookup(A + [1])
    assert hit.hit_tokens == 16  # blocks 0..3: block 4 failed, so 5 cannot be used either
    assert (s.tiered.stats.promotion_failures, s.ssd.stats().quarantined) == (1, 1)
    assert not path.exists()
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    s.ssd.close()


def test_partial_tail_comes_back_from_ssd(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=9)
    s.store(A + [7, 8], 0)  # 6 blocks + a 2-token partial
    s.store(C, 50)
    s.ssd.flush()
    hit = s.lookup(A + [7, 8, 9])
    assert len(hit.blocks) == 6
    assert [(c.tokens, m) for c, m in hit.tail_candidates] == [((7, 8), 2)]
    assert hit.hit_tokens == 26
    s.ssd.close()


def test_other_namespace_is_never_served(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=8)
    s.store(A, 0)
    s.store(C, 50)
    s.ssd.flush()
    hit = s.lookup(A + [1], namespace="someone-else")
    assert hit.hit_tokens == 8  # only A's resident blocks 0..1
    assert (s.tiered.stats.promotions, s.tiered.stats.misses) == (0, 1)
    s.ssd.close()


def test_queued_blocks_are_served_before_they_reach_disk(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=8)
    stored = s.store(A, 0)
    s.store(C, 50)
    hit = s.lookup(A + [1])  # no flush: whatever is still queued comes from memory
    assert [b.block_hash for b in hit.blocks] == [b.block_hash for b in stored]
    stats = s.ssd.stats()
    assert stats.queue_reads + stats.reads == 4
    s.ssd.close()


@pytest.mark.parametrize("where", ["block", "partial"])
def test_recurrent_promotes_only_up_to_a_checkpoint(tmp_path: Path, where: str) -> None:
    s = Setup(tmp_path, budget_blocks=14, needs_checkpoint=True)
    if where == "block":
        # Full blocks 0..5, block 1 ends with a checkpoint (length 8).
        s.store(A, 0, checkpoints=(1,))
        expected_blocks, expected_tail = 2, None
    else:
        # Blocks 0..3 and a checkpointed partial at length 18 (a restore point at depth 4).
        s.store(A[:18], 0, partial_checkpoint=True)
        s.store(A, 0)  # the rest of the chain, without checkpoints
        expected_blocks, expected_tail = 4, (116, 117)
    for i in range(3):
        s.store([300 + 40 * i + k for k in range(24)], 60 + 10 * i)  # push everything of A out
    s.ssd.flush()
    assert not any(b.tokens[0] >= 100 and b.tokens[0] < 124 for b in s.cache.pool)
    hit = s.lookup(A + [1])
    assert len(hit.blocks) == expected_blocks
    tails = [c.tokens for c, m in hit.tail_candidates if m == c.num_tokens]
    assert tails == ([expected_tail] if expected_tail else [])
    promoted = expected_blocks + (1 if expected_tail else 0)
    assert s.tiered.stats.promotions == promoted  # nothing past the restore point is read
    s.ssd.close()


def test_blocks_record_the_namespace_they_are_stored_under(tmp_path: Path) -> None:
    s = Setup(tmp_path, budget_blocks=20)
    stored = s.store(A[:10], 0)  # two full blocks and a partial, through PrefixCache.store
    assert [(b.num_tokens, b.namespace) for b in stored] == [(4, NAMESPACE), (4, NAMESPACE), (2, NAMESPACE)]
    harvested = s.tiered.store_for("tenant-b").insert_block(
        ROOT, C[:4], (), payload(7, B), "s2", partial=False
    )
    assert (harvested.namespace, harvested.owners) == ("tenant-b", {"s2"})
    s.ssd.close()


def test_tail_match_is_the_lookup_tail_rule() -> None:
    from kv_cache.prefix_cache import tail_match

    image = b"\x05" * 16
    # Common prefix, capped.
    assert tail_match((1, 2, 3, 4), (), (1, 2, 9, 9), (), 4) == 2
    assert tail_match((1, 2, 3, 4), (), (1, 2, 3, 4), (), 3) == 3
    # Same tokens, a different image from offset 1: only the token before it matches.
    assert tail_match((1, 2, 3, 4), ((image, 1),), (1, 2, 3, 4), ((b"\x06" * 16, 1),), 4) == 1
    assert tail_match((1, 2, 3, 4), ((image, 1),), (1, 2, 3, 4), ((image, 1),), 4) == 4


def test_close_writes_resident_blocks_newest_that_fit(tmp_path: Path) -> None:
    big = [payload(i, 64) for i in range(6)]  # 8 KiB each: file headers are small beside them
    ssd = open_tier(tmp_path, budget_bytes=int(4.7 * big[0].nbytes))
    cache = PrefixCache(B, RamTier(1 << 20), on_evict=ssd.spill)
    tiered = TieredPrefixCache(cache, ssd, needs_checkpoint=False)
    stored = cache.store(ROOT, A, (), big, None, owner="s1", namespace=NAMESPACE)
    tiered.close()
    assert tiered.stats.flushed == 4
    assert ssd.stats().capacity_deletions == 0  # the two oldest were never written
    again = open_tier(tmp_path)
    # RAM ages a chain deepest first: the 4 most recently used are blocks 0..3.
    found = again.find_blocks([b.block_hash for b in stored])
    assert sorted(found) == sorted(b.block_hash for b in stored[:4])
    again.close()
