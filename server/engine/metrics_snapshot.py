"""A typed, point-in-time copy of the engine's counters, for the Prometheus collector.

The engine owns every value (plain ints it updates on its own thread); a scrape copies them
from the HTTP side without queueing behind a running request and without any MLX work. Python
reads of ints and lock-protected stats are safe across threads; a scrape taken during a request
may see that request half counted, which the next scrape corrects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kv_cache.prefix_cache import PrefixCache
from kv_cache.tiers.ram import RamTier
from kv_cache.tiers.ssd_stats import SsdStats
from server.engine.miss_tracking import MissTracker
from vision_cache.feature_cache import FeatureCache


@dataclass(frozen=True, slots=True)
class TierSnapshot:
    """One cache in one tier.

    Attributes:
        cache: ``kv`` (prefix blocks) or ``vision`` (encoder features).
        tier: ``ram`` or ``ssd`` (later ``redis``).
        resident_bytes: Bytes held now.
        budget_bytes: The tier's byte budget (None when unbounded or unknown).
        entries: Blocks or feature entries held now.
        evictions: Entries evicted for room.
        spills: Entries handed to the next tier down on eviction.
        drops: Entries lost without being stored (e.g. a full write queue).
        promotions: Entries copied up into RAM on a hit.
        quarantined: Corrupt entries moved aside.
    """

    cache: str
    tier: str
    resident_bytes: int
    budget_bytes: int | None
    entries: int
    evictions: int = 0
    spills: int = 0
    drops: int = 0
    promotions: int = 0
    quarantined: int = 0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """All tenants together (no per-tenant values: metrics carry no tenant labels).

    Attributes:
        requests: Requests that completed prefill.
        prompt_tokens: Prompt tokens of those requests (the prefix cache's queries).
        cached_tokens: Prompt tokens restored from the cache (sum of ``hit_tokens_by_tier``).
        completion_tokens: Tokens generated.
        hit_tokens_by_tier: Restored prompt tokens by the tier that held them.
        vision_queries: Images whose features were needed.
        vision_hits: Of those, found in the feature cache.
        encoder_runs: Vision tower runs.
        hit_blocks: Full blocks matched by lookups.
        miss_blocks: Missed full blocks by reason (all reasons, ``isolated`` included).
        rolling_block_hit_rate: Block hit rate over the warning window (None before data).
        hit_rate_warnings: Low-hit-rate warnings logged.
        tiers: Each cache in each tier.
    """

    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    hit_tokens_by_tier: Mapping[str, int]
    vision_queries: int
    vision_hits: int
    encoder_runs: int
    hit_blocks: int
    miss_blocks: Mapping[str, int]
    rolling_block_hit_rate: float | None
    hit_rate_warnings: int
    tiers: tuple[TierSnapshot, ...] = field(default=())


@runtime_checkable
class MetricsSource(Protocol):
    """An engine that can be scraped (``ModelRunner``); test engines need not be."""

    def metrics_snapshot(self) -> EngineSnapshot:
        """Copy the counters; callable from any thread, never runs MLX work."""
        ...


def snapshot_of(
    *,
    counters: Iterable[object],
    prefix_cache: PrefixCache,
    ram: RamTier,
    features: FeatureCache,
    misses: MissTracker,
    lower_tiers: Iterable[TierSnapshot] = (),
) -> EngineSnapshot:
    """Build a snapshot from the runner's parts.

    Args:
        counters: The per-tenant ``TenantCounters`` (pass a list copy of the dict's values);
            ``cached_tokens_ssd`` of them were served by blocks promoted from SSD.
        prefix_cache: The RAM prefix cache.
        ram: Its RAM budget.
        features: The vision feature cache (RAM).
        misses: Miss reasons and the rolling hit rate.
        lower_tiers: Snapshots of the SSD (and later Redis) tiers, when configured.
    """
    totals = {name: 0 for name in ("requests", "prompt_tokens", "cached_tokens",
                                   "completion_tokens", "vision_queries", "vision_hits",
                                   "encoder_runs", "cached_tokens_ssd")}
    for c in counters:
        for name in totals:
            totals[name] += getattr(c, name)
    kv = prefix_cache.stats
    vision = features.stats()
    counts = misses.attributor.counts(None)
    lower = tuple(lower_tiers)
    by_tier = {"ram": totals["cached_tokens"] - totals["cached_tokens_ssd"]}
    if any(t.tier == "ssd" for t in lower):
        by_tier["ssd"] = totals["cached_tokens_ssd"]
    return EngineSnapshot(
        requests=totals["requests"],
        prompt_tokens=totals["prompt_tokens"],
        cached_tokens=totals["cached_tokens"],
        completion_tokens=totals["completion_tokens"],
        hit_tokens_by_tier=by_tier,
        vision_queries=totals["vision_queries"],
        vision_hits=totals["vision_hits"],
        encoder_runs=totals["encoder_runs"],
        hit_blocks=counts.hit_blocks,
        miss_blocks=counts.as_dict(tenant_view=False),
        rolling_block_hit_rate=misses.monitor.hit_rate,
        hit_rate_warnings=misses.monitor.warning_count,
        tiers=(
            TierSnapshot("kv", "ram", prefix_cache.resident_bytes, ram.budget_bytes,
                         len(prefix_cache), evictions=kv.evictions,
                         drops=kv.rejected),
            TierSnapshot("vision", "ram", vision.resident_bytes, features.budget_bytes,
                         vision.entries, evictions=vision.evictions, drops=vision.rejected),
            *lower,
        ),
    )


def ssd_tier_snapshot(stats: SsdStats, *, promotions: int) -> TierSnapshot:
    """The SSD tier as a ``TierSnapshot`` (pass it in ``snapshot_of(lower_tiers=...)``).

    KV blocks and vision features share one SSD tier (one index, capacity and writer), so its
    row is labelled ``cache="all"``.

    Args:
        stats: ``SsdTier.stats()``.
        promotions: Entries read back into RAM (KV promotions plus vision-feature SSD hits).
    """
    return TierSnapshot(
        cache="all",
        tier="ssd",
        resident_bytes=stats.bytes,
        budget_bytes=stats.budget_bytes,
        entries=stats.files,
        evictions=stats.capacity_deletions,
        spills=stats.spills,
        drops=stats.drops,
        promotions=promotions,
        quarantined=stats.quarantined,
    )


def ssd_served_tokens(used_tokens: Sequence[int], promoted: int, restored: int) -> int:
    """Restored tokens that came from blocks promoted out of SSD by this request's lookup.

    The tiered lookup promotes only blocks the restore will use, and RAM evicts the deepest
    blocks of a chain first, so the promoted blocks are the last ``promoted`` of those used.

    Args:
        used_tokens: Tokens each used block contributed, in chain order (a tail block counts
            only the tokens used of it).
        promoted: Blocks the lookup promoted from SSD.
        restored: The restored length (the result never exceeds it).
    """
    if promoted <= 0:
        return 0
    return min(restored, sum(used_tokens[-promoted:]))
