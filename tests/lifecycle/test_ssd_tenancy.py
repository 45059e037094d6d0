"""The SSD tier's tenant rules: quotas and guaranteed shares in the capacity pass, retention
(rows and files of expired records), erasure of a namespace (rows, files, directories)."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

from kv_cache.hashing import BlockHash
from kv_cache.tally import Tally
from kv_cache.tiers.ssd import SsdTier
from kv_cache.tiers.ssd_index import RecordKind, SsdIndex
from tests.ssd.factories import NAMESPACE, ROOT, STORED_AT, block, block_files, open_tier

NS_A = NAMESPACE
NS_B = "nsbbbbbbbbbbbbbb"


def blocks_of(namespace: str, count: int, first_seed: int) -> list:
    """``count`` root children of one namespace, tokens of equal width (files of equal size)."""
    return [
        block(ROOT, [1000 + 4 * (first_seed + i) + k for k in range(4)], first_seed + i, namespace=namespace)
        for i in range(count)
    ]


def spill_all(tier: SsdTier, blocks: list) -> None:
    for b in blocks:
        assert tier.spill(b)
        tier.flush()  # one commit at a time: deterministic LRU stamps and capacity passes


def stored(tier: SsdTier, namespace: str) -> list[BlockHash]:
    return sorted(BlockHash(r.key) for r in tier.rows(RecordKind.KV) if r.namespace == namespace)


def file_size(tier: SsdTier) -> int:
    sizes = {r.size for r in tier.rows(RecordKind.KV)}
    assert len(sizes) == 1, sizes  # the quotas below are in whole files
    return sizes.pop()


def test_tenant_over_its_ssd_quota_loses_its_own_oldest_files(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, clock=itertools.count(1).__next__)
    a, b = blocks_of(NS_A, 6, 0), blocks_of(NS_B, 2, 10)
    spill_all(tier, b + a[:5])
    size = file_size(tier)
    tier.set_quota(NS_A, 3 * size + size // 2)
    assert stored(tier, NS_A) == sorted(x.block_hash for x in a[2:5])
    spill_all(tier, a[5:])  # the commit's capacity pass: A's oldest again
    assert stored(tier, NS_A) == sorted(x.block_hash for x in a[3:6])
    assert stored(tier, NS_B) == sorted(x.block_hash for x in b)
    stats = tier.stats()
    assert (stats.capacity_deletions, stats.files, stats.bytes) == (3, 5, 5 * size)
    assert tier.usage() == {NS_A: 3 * size, NS_B: 2 * size}
    assert {p.name.split(".")[0] for p in block_files(tmp_path)} == {
        x.block_hash.hex() for x in [*a[3:], *b]}
    tier.close()


def test_flooding_tenant_cannot_push_a_guaranteed_tenant_below_its_share(tmp_path: Path) -> None:
    probe = open_tier(tmp_path / "probe")
    spill_all(probe, blocks_of(NS_A, 1, 0))
    size = file_size(probe)
    probe.close()
    tier = open_tier(tmp_path / "cache", budget_bytes=6 * size + size // 2, clock=itertools.count(1).__next__)
    tier.set_quota(NS_B, 3 * size + size // 2)
    b = blocks_of(NS_B, 3, 10)
    a = blocks_of(NS_A, 5, 0)
    spill_all(tier, b + a)  # B's files are the oldest; A (no quota) must give room itself
    assert stored(tier, NS_B) == sorted(x.block_hash for x in b)
    assert stored(tier, NS_A) == sorted(x.block_hash for x in a[2:])
    tier.close()


def test_expire_deletes_rows_and_files_stored_before_the_cutoff(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    a, b = blocks_of(NS_A, 4, 0), blocks_of(NS_B, 2, 10)  # stored at STORED_AT + seed
    spill_all(tier, a + b)
    size = file_size(tier)
    removed = tier.expire({NS_A: STORED_AT + 2})  # seeds 0, 1 of A are older; B has no retention
    assert removed == {RecordKind.KV: Tally(2, 2 * size), RecordKind.VISION: Tally()}
    assert stored(tier, NS_A) == sorted(x.block_hash for x in a[2:])
    assert stored(tier, NS_B) == sorted(x.block_hash for x in b)
    assert len(block_files(tmp_path)) == 4
    assert tier.stats().files == 4 and tier.usage() == {NS_A: 2 * size, NS_B: 2 * size}
    tier.close()


def test_erase_namespace_removes_rows_files_and_directories(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    a, b = blocks_of(NS_A, 3, 0), blocks_of(NS_B, 2, 10)
    spill_all(tier, a + b)
    size = file_size(tier)
    removed = tier.erase_namespace(NS_A)
    assert removed[RecordKind.KV] == Tally(3, 3 * size)
    assert stored(tier, NS_A) == [] and stored(tier, NS_B) == sorted(x.block_hash for x in b)
    assert not (tier.layout.tree(RecordKind.KV) / NS_A).exists()
    assert (tier.layout.tree(RecordKind.KV) / NS_B).is_dir()
    # The index was rebuilt: the erased keys are nowhere in its files.
    raw = b"".join(p.read_bytes() for p in tier.layout.index_path.parent.iterdir() if p.is_file())
    assert not any(bytes(x.block_hash) in raw for x in a)
    assert all(bytes(x.block_hash) in raw for x in b)
    tier.close()


def test_a_new_tier_counts_usage_per_namespace_from_the_index(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    spill_all(tier, blocks_of(NS_A, 2, 0) + blocks_of(NS_B, 1, 10))
    size = file_size(tier)
    tier.close()
    reopened = open_tier(tmp_path)
    assert reopened.usage() == {NS_A: 2 * size, NS_B: size}
    reopened.close()


def test_an_index_of_schema_1_gains_stored_at_zero_so_any_retention_expires_it(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE entries (kind TEXT NOT NULL, key BLOB NOT NULL, namespace TEXT NOT NULL,
            size INTEGER NOT NULL, nbytes INTEGER NOT NULL, last_access INTEGER NOT NULL,
            owners TEXT NOT NULL, parent BLOB, tokens BLOB, extra TEXT,
            partial INTEGER NOT NULL DEFAULT 0, checkpointed INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (kind, key)) WITHOUT ROWID;
        PRAGMA user_version=1;
    """)
    db.execute("INSERT INTO entries VALUES ('vision', ?, ?, 10, 8, 5, '[\"s\"]', NULL, NULL, NULL, 0, 0)",
               (b"\x07" * 16, NS_A))
    db.commit()
    db.close()
    index = SsdIndex(path)
    (row,) = index.rows()
    assert (row.key, row.owners, row.stored_at) == (b"\x07" * 16, ("s",), 0.0)
    assert [r.key for r in index.stored_before(NS_A, 1.0)] == [b"\x07" * 16]
    index.close()
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone()[0] == 2
