"""The SSD tier on its own: spill, index-only lookup, verified reads, queue, capacity,
reconcile, quarantine, the directory lock."""

from __future__ import annotations

import itertools
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from kv_cache.hashing import BlockHash
from kv_cache.serialization import BlockMeta, host_tensor
from kv_cache.tiers.ssd import SsdTierBusyError
from kv_cache.tiers.ssd_index import IndexRow, RecordKind
from kv_cache.tiers.ssd_reconcile import ReconcileReport
from kv_cache.tiers.ssd_writer import SsdWriter, WriteJob
from tests.ssd.factories import (
    FINGERPRINT,
    NAMESPACE,
    ROOT,
    block,
    block_files,
    chain,
    open_tier,
    same_payload,
    temp_files,
)


def meta_of(b) -> BlockMeta:
    return BlockMeta(
        b.block_hash, b.parent, b.tokens, b.extra, b.is_partial, b.payload.checkpoint is not None,
        b.namespace, tuple(sorted(b.owners)), b.payload.nbytes, b.stored_at,
    )


def test_spilled_blocks_are_indexed_and_read_back_verified(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    blocks = chain(3)
    tail = block(blocks[-1].block_hash, [12, 13], 9, partial=True, checkpoint=True)
    for b in [*blocks, tail]:
        assert tier.spill(b)
    tier.flush()
    found = tier.find_blocks([b.block_hash for b in blocks] + [BlockHash(b"\x01" * 16)])
    assert found == {b.block_hash: meta_of(b) for b in blocks}
    assert tier.children(blocks[-1].block_hash) == [meta_of(tail)]
    for b in [*blocks, tail]:
        assert same_payload(tier.load_block(meta_of(b)), b.payload)
    hexes = sorted(b.block_hash.hex() for b in [*blocks, tail])
    expected = [
        tmp_path / "kv" / FINGERPRINT[:16] / NAMESPACE / h[:2] / h[2:4] / f"{h}.safetensors"
        for h in hexes
    ]
    assert block_files(tmp_path) == expected
    stats = tier.stats()
    assert (stats.spills, stats.files, stats.reads, stats.drops, stats.queued) == (4, 4, 4, 0, 0)
    assert stats.bytes == sum(p.stat().st_size for p in expected) == stats.spilled_bytes
    assert temp_files(tmp_path) == []
    tier.close()


def test_spilling_a_stored_block_again_only_updates_owners(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    b = block(ROOT, [1, 2, 3, 4], 1, owners=("s1",))
    tier.spill(b)
    tier.flush()
    b.owners.add("s2")
    assert tier.spill(b)
    tier.flush()
    assert tier.find_blocks([b.block_hash])[b.block_hash].owners == ("s1", "s2")
    stats = tier.stats()
    assert (stats.spills, stats.already_stored, stats.files) == (1, 1, 1)
    tier.close()


def test_block_without_namespace_is_not_written(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    assert not tier.spill(block(ROOT, [1, 2, 3, 4], 1, namespace=None))
    tier.flush()
    assert (tier.stats().unfiled, tier.stats().spills) == (1, 0)
    with pytest.raises(ValueError, match="namespace"):
        tier.spill(block(ROOT, [1, 2, 3, 4], 1, namespace="../escape"))
    tier.close()


def _job(tmp_path: Path, i: int) -> WriteJob:
    import mlx.core as mx

    array = mx.arange(4 * (i + 1), dtype=mx.float32)
    mx.eval(array)
    row = IndexRow(RecordKind.VISION, bytes([i]) * 16, NAMESPACE, 0, array.nbytes, i)
    return WriteJob(tmp_path / f"{i}.safetensors", (host_tensor("x", array),), {"i": i}, row, f"value-{i}")


def test_full_queue_drops_and_a_queued_record_is_served_from_memory(tmp_path: Path) -> None:
    gate = threading.Event()
    committed: list[int] = []

    def commit(job: WriteJob, size: int) -> None:
        gate.wait(30)  # holds the writer after job 0's file is in place
        committed.append(job.metadata["i"])

    writer = SsdWriter(2, commit, lambda job, error: pytest.fail(str(error)))
    jobs = [_job(tmp_path, i) for i in range(6)]
    assert writer.submit(jobs[0])
    deadline = time.monotonic() + 30
    while not (tmp_path / "0.safetensors").exists():  # the writer is now inside commit(job 0)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    accepted = [writer.submit(job) for job in jobs[1:]]
    assert accepted == [True, True, False, False, False]
    assert writer.pending(RecordKind.VISION, bytes([2]) * 16).value == "value-2"
    assert writer.pending(RecordKind.VISION, bytes([3]) * 16) is None
    assert writer.submit(jobs[1])  # already queued: not queued twice
    gate.set()
    writer.flush()
    assert committed == [0, 1, 2]
    assert writer.pending_jobs() == []
    writer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.safetensors", "1.safetensors", "2.safetensors"]


def test_queued_or_written_block_loads_the_same_payload(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    blocks = chain(8, start_seed=40)
    for b in blocks:
        tier.spill(b)
    # Immediately: each comes from the queue or from its file, never missing.
    for b in blocks:
        assert tier.find_blocks([b.block_hash])[b.block_hash] == meta_of(b)
        assert same_payload(tier.load_block(meta_of(b)), b.payload)
    stats = tier.stats()
    assert stats.queue_reads + stats.reads == 8
    tier.close()


def test_capacity_deletes_least_recently_used_files(tmp_path: Path) -> None:
    clock = itertools.count(1000)
    blocks = chain(4)
    probe = open_tier(tmp_path / "probe")
    probe.spill(blocks[0])
    probe.flush()
    size = probe.stats().bytes
    probe.close()
    tier = open_tier(tmp_path / "cache", budget_bytes=int(size * 2.5), clock=clock.__next__)
    for b in blocks[:2]:
        tier.spill(b)
    tier.flush()
    assert tier.load_block(meta_of(blocks[0])) is not None  # block 0 is now newer than block 1
    hashes = [b.block_hash for b in blocks]
    tier.spill(blocks[2])
    tier.flush()
    assert sorted(tier.find_blocks(hashes)) == sorted([hashes[0], hashes[2]])  # 1 was oldest
    tier.spill(blocks[3])
    tier.flush()
    assert sorted(tier.find_blocks(hashes)) == sorted([hashes[2], hashes[3]])
    stats = tier.stats()
    files = block_files(tmp_path / "cache")
    assert (stats.files, stats.capacity_deletions) == (2, 2)
    assert stats.bytes == sum(f.stat().st_size for f in files) <= stats.budget_bytes
    assert len(files) == 2
    tier.close()


def test_reconcile_repairs_every_disagreement(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    blocks = chain(5)
    for b in blocks:
        tier.spill(b)
    tier.close()
    paths = {b.block_hash: tier.layout.path(RecordKind.KV, NAMESPACE, b.block_hash) for b in blocks}
    db = sqlite3.connect(tier.layout.index_path)
    # 0: row without file.  1: valid file without row.  2: corrupt file without row.
    # 3: file truncated under its row.  4: untouched.
    paths[blocks[0].block_hash].unlink()
    db.execute("DELETE FROM entries WHERE key IN (?, ?)", (blocks[1].block_hash, blocks[2].block_hash))
    db.commit()
    db.close()
    corrupt = bytearray(paths[blocks[2].block_hash].read_bytes())
    corrupt[-1] ^= 0xFF
    paths[blocks[2].block_hash].write_bytes(bytes(corrupt))
    data = paths[blocks[3].block_hash].read_bytes()
    paths[blocks[3].block_hash].write_bytes(data[: len(data) // 2])
    leaf = paths[blocks[4].block_hash].parent
    (leaf / ".half-written.safetensors.123.abcd.tmp").write_bytes(b"partial")
    (leaf / "README").write_text("not ours")

    tier = open_tier(tmp_path)
    assert tier.reconcile_report == ReconcileReport(
        temp_removed=1, rows_dropped=2, adopted=1, removed=2, strays=1
    )
    found = tier.find_blocks([b.block_hash for b in blocks])
    assert sorted(found) == sorted([blocks[1].block_hash, blocks[4].block_hash])
    assert same_payload(tier.load_block(found[blocks[1].block_hash]), blocks[1].payload)
    assert block_files(tmp_path) == sorted([paths[blocks[1].block_hash], paths[blocks[4].block_hash]])
    assert temp_files(tmp_path) == []
    assert tier.stats().files == 2
    tier.close()


def test_corrupt_file_is_quarantined_and_read_as_a_miss(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    b = block(ROOT, [1, 2, 3, 4], 5)
    tier.spill(b)
    tier.flush()
    path = tier.layout.path(RecordKind.KV, NAMESPACE, b.block_hash)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    assert tier.load_block(meta_of(b)) is None
    assert not path.exists()
    quarantined = list((tmp_path / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith(f"kv-{b.block_hash.hex()}-")
    assert quarantined[0].read_bytes() == bytes(data)
    assert tier.find_blocks([b.block_hash]) == {}
    stats = tier.stats()
    assert (stats.quarantined, stats.files, stats.bytes) == (1, 0, 0)
    tier.close()


def test_one_open_tier_per_directory_and_model(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    with pytest.raises(SsdTierBusyError):
        open_tier(tmp_path)
    tier.close()
    again = open_tier(tmp_path)
    again.close()
