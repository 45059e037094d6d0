"""Quotas on the engine: tenant A flooding the RAM tier does not evict tenant B's blocks within
B's guaranteed share, while without B's quota the same flood does (so the guarantee is what
protects them)."""

from __future__ import annotations

from tests.engine.conftest import msg, run
from tests.lifecycle.engine import SYSTEM, make_runner, tenant

BUDGET = 40 * 8192  # about 40 blocks of the tiny model


def b_conversation():
    return [msg("system", SYSTEM), msg("user", "Please track parcel 99 for me, it is urgent.")]


def flood(runner, a) -> None:
    for i in range(12):
        run(runner, a, [msg("user", f"Flood request number {i}: " + "tell me everything " * 8)],
            session=f"a{i}", max_tokens=4)


def scenario(b_quota: int | None, *, flooded: bool = True) -> tuple[bool, int]:
    """B's blocks all still resident after A's flood, and B's cached tokens on a repeat."""
    a = tenant("alice")
    b = tenant("bob", ram_quota_bytes=b_quota) if b_quota is not None else tenant("bob")
    runner = make_runner(None, ram_budget_bytes=BUDGET)
    run(runner, b, b_conversation(), session="b")
    held = [blk for blk in runner.prefix_cache.pool if blk.namespace == b.namespace]
    if flooded:
        flood(runner, a)
        assert runner.ram.usage_of(a.namespace) > BUDGET // 3
    kept = all(blk.resident for blk in held)
    again = run(runner, b, b_conversation(), session="b")
    assert runner.ram.used_bytes <= BUDGET
    return kept, again.usage.cached_tokens


def test_a_flood_cannot_evict_a_tenant_within_its_guaranteed_share() -> None:
    _, undisturbed = scenario(b_quota=BUDGET // 2, flooded=False)
    kept, cached = scenario(b_quota=BUDGET // 2)
    assert kept
    assert cached == undisturbed > 0


def test_without_a_quota_the_same_flood_evicts_by_plain_lru() -> None:
    _, undisturbed = scenario(b_quota=None, flooded=False)
    kept, cached = scenario(b_quota=None)
    assert not kept
    assert cached < undisturbed


def test_the_engine_applies_a_tenants_ssd_quota(tmp_path) -> None:
    small, other = tenant("small", ssd_quota_bytes=40_000), tenant("other")
    runner = make_runner(tmp_path, ram_budget_bytes=4 * 8192)  # most blocks spill to SSD
    for t in (small, other):
        for i in range(4):
            run(runner, t, [msg("user", f"Request {i}: " + "describe the parcel " * 8)], session=f"s{i}")
    runner.ssd.flush()
    usage = runner.ssd.usage()
    assert 0 < usage[small.namespace] <= 40_000 < usage[other.namespace]
    assert runner.ssd.stats().capacity_deletions > 0
    assert runner.cache_stats(small)["usage"]["ssd_bytes"] == usage[small.namespace]
    runner.close()
