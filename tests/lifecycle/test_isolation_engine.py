"""Isolation matrix on the engine: tenants A and B send identical text, identical images and
identical system prompts; B never gets a hit from A's state in RAM, in the vision cache, or on
SSD after a restart, and A's stats never count B's traffic."""

from __future__ import annotations

from pathlib import Path

from kv_cache.tiers.ssd_index import RecordKind
from tests.engine.conftest import image_part, msg, picture, run
from tests.lifecycle.engine import SYSTEM, make_runner, tenant


def conversation(t):
    return [msg("system", SYSTEM), msg("user", image_part(t, picture(3)), "What is printed on this label?")]


def test_identical_requests_of_two_tenants_share_nothing_in_ram_or_vision(tmp_path: Path) -> None:
    a, b = tenant("alice"), tenant("bob")
    runner = make_runner(tmp_path)
    first_a = run(runner, a, conversation(a), session="s1")
    again_a = run(runner, a, conversation(a), session="s1")
    assert first_a.usage.cached_tokens == 0 and again_a.usage.cached_tokens > 0
    stats_a = runner.cache_stats(a)

    first_b = run(runner, b, conversation(b), session="s1")  # same session id too

    assert (first_b.trace.prompt_ids == first_a.trace.prompt_ids).all()  # identical tokens
    assert first_b.usage.cached_tokens == 0
    assert (first_b.trace.encoder_runs, first_b.trace.vision_hits) == (1, 0)
    assert runner.cache_stats(a) == stats_a
    stats_b = runner.cache_stats(b)
    assert (stats_b["requests"], stats_b["cached_tokens"], stats_b["vision_hits"]) == (1, 0, 0)
    assert stats_b["miss_reasons"]["cold"] == stats_b["missed_blocks"] > 0
    assert "isolated" not in stats_b["miss_reasons"]  # a tenant cannot probe the others
    assert runner.cache_stats(None)["miss_reasons"]["isolated"] == stats_b["missed_blocks"]
    blocks_a = {blk.block_hash for blk in runner.prefix_cache.pool if blk.namespace == a.namespace}
    blocks_b = {blk.block_hash for blk in runner.prefix_cache.pool if blk.namespace == b.namespace}
    assert blocks_a and blocks_b and not blocks_a & blocks_b
    assert runner.features.stats(a.namespace).entries == runner.features.stats(b.namespace).entries == 1
    runner.close()


def test_after_a_restart_the_ssd_tier_serves_a_tenant_only_its_own_state(tmp_path: Path) -> None:
    a, b = tenant("alice"), tenant("bob")
    before = make_runner(tmp_path)
    run(before, a, conversation(a), session="s1")
    before.close()  # every block and the features of A on disk
    runner = make_runner(tmp_path)
    rows = runner.ssd.rows(RecordKind.KV) + runner.ssd.rows(RecordKind.VISION)
    on_disk = {(row.kind, row.namespace) for row in rows}
    assert on_disk == {(RecordKind.KV, a.namespace), (RecordKind.VISION, a.namespace)}

    first_b = run(runner, b, conversation(b), session="s1")
    assert first_b.usage.cached_tokens == 0
    assert (runner.tiered.stats.promotions, runner.feature_ssd.stats.hits) == (0, 0)
    assert (first_b.trace.encoder_runs, first_b.trace.vision_hits) == (1, 0)
    assert runner.cache_stats(a)["requests"] == 0

    # A's state is there and reachable: the same request from A is served from SSD.
    again_a = run(runner, a, conversation(a), session="s1")
    assert again_a.usage.cached_tokens > 0 and runner.tiered.stats.promotions > 0
    runner.close()
