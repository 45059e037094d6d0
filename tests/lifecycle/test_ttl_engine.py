"""Retention on the engine with an injected clock: once a tenant's state is older than its
retention it is never served (in RAM, on SSD, in the vision cache), even before a sweep, the
misses are attributed to ``expired``, and a sweep leaves nothing of it on disk."""

from __future__ import annotations

from pathlib import Path

from kv_cache.tiers.ssd_index import RecordKind
from tests.engine.conftest import image_part, msg, picture, run
from tests.lifecycle.engine import SYSTEM, file_names, make_runner, spill_resident, tenant
from tests.lifecycle.factories import Clock

RETENTION = 60.0


def conversation(t):
    return [msg("system", SYSTEM), msg("user", image_part(t, picture(8)), "Read this label, please.")]


def test_expired_state_is_not_served_and_is_gone_from_disk_after_a_sweep(tmp_path: Path) -> None:
    clock = Clock(50_000.0)
    short, other = tenant("short", retention_seconds=RETENTION), tenant("forever")
    runner = make_runner(tmp_path, clock=clock)
    run(runner, short, conversation(short), session="s")
    run(runner, other, conversation(other), session="s")
    clock.now += RETENTION - 1  # still within retention: everything hits
    warm = run(runner, short, conversation(short), session="s")
    assert warm.usage.cached_tokens > 0
    spill_resident(runner)
    old_files = set(file_names(tmp_path / "kv"))
    assert old_files

    clock.now += 2  # 61 s after the first request
    expired = run(runner, short, conversation(short), session="s")
    assert expired.usage.cached_tokens == 0  # not from RAM, not from SSD
    assert (expired.trace.encoder_runs, expired.trace.vision_hits) == (1, 0)
    stats = runner.cache_stats(short)
    reasons = stats["miss_reasons"]
    assert reasons["expired"] > 0 and reasons["expired"] == stats["missed_blocks"] - reasons["cold"]
    assert run(runner, other, conversation(other), session="s").usage.cached_tokens > 0

    report = runner.sweep()
    assert report.kv_ssd.count > 0
    cutoff = clock.now - RETENTION
    rows = runner.ssd.rows(RecordKind.KV) + runner.ssd.rows(RecordKind.VISION)
    assert all(row.stored_at >= cutoff for row in rows if row.namespace == short.namespace)
    assert not (tmp_path / "kv" / runner.ssd.layout.model_dir / short.namespace).exists()
    assert {row.namespace for row in runner.ssd.rows(RecordKind.KV)} == {other.namespace}
    # The recomputed state is fresh and hits again; closing writes it with its new age.
    assert run(runner, short, conversation(short), session="s").usage.cached_tokens > 0
    runner.close()
    reopened = make_runner(tmp_path, clock=clock)
    fresh = [row for row in reopened.ssd.rows(RecordKind.KV) if row.namespace == short.namespace]
    assert fresh and all(row.stored_at >= cutoff for row in fresh)
    reopened.close()


def test_a_sweep_drops_expired_ram_blocks_and_features(tmp_path: Path) -> None:
    clock = Clock(10_000.0)
    short = tenant("short", retention_seconds=RETENTION)
    runner = make_runner(None, clock=clock)
    run(runner, short, conversation(short), session="s")
    blocks = [blk for blk in runner.prefix_cache.pool if blk.namespace == short.namespace]
    clock.now += RETENTION + 1
    report = runner.sweep()
    assert report.kv_ram.count == len(blocks) > 0
    assert report.vision_ram.count == 1
    assert not any(blk.resident for blk in blocks)
    assert runner.ram.usage_of(short.namespace) == 0


def test_reply_ledger_entries_expire_with_the_tenant_retention() -> None:
    from server.engine.prompt import ReplyLedger

    clock = Clock(1_000.0)
    ledger = ReplyLedger(clock=clock)
    ledger.record("short", "a reply", [5, 6, 7], session="s")
    ledger.record("forever", "a reply", [8], session="s")
    clock.now += 30
    ledger.record("short", "a later reply", [9], session="s")
    cutoff = clock.now - 20  # retention 20 s: only the later reply is young enough
    assert ledger.get("short", "a reply", expired_before=cutoff) is None  # checked on read
    assert ledger.get("short", "a later reply", expired_before=cutoff) == (9,)
    ledger.record("short", "old again", [1], session="s")
    clock.now += 25
    assert ledger.expire({"short": clock.now - 20}) == 2  # both "short" entries now expired
    assert ledger.get("short", "a later reply") is None
    assert ledger.get("forever", "a reply") == (8,)  # no retention: kept
