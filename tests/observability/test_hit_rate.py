"""The rolling hit-rate warning: once per low episode, naming the dominant reason."""

from __future__ import annotations

import logging

import pytest

from kv_cache.hit_rate import SUGGESTIONS, HitRateMonitor
from kv_cache.miss_reasons import MissReason, MissReport

EVICTED, COLD = MissReason.EVICTED, MissReason.COLD


def test_one_warning_with_the_dominant_reason(caplog: pytest.LogCaptureFixture) -> None:
    monitor = HitRateMonitor(threshold=0.5, window=4)
    caplog.set_level(logging.WARNING, logger="kv_cache.hit_rate")
    low = MissReport(1, (EVICTED, EVICTED, COLD))  # 1 hit of 4 blocks
    assert [monitor.observe(low) for _ in range(3)] == [None, None, None]  # window not full yet
    warning = monitor.observe(low)
    assert warning is not None
    assert (warning.reason, warning.hit_rate, round(warning.share, 4)) == (EVICTED, 0.25, 0.6667)
    assert warning.message == (
        "prefix cache hit rate over the last 4 requests is 25% (warning threshold 50%); 67% of "
        f"missed blocks were evicted: {SUGGESTIONS[EVICTED]}")
    assert [r.getMessage() for r in caplog.records] == [warning.message]
    # Still low: no second warning.
    for _ in range(10):
        assert monitor.observe(low) is None
    assert (monitor.warning_count, len(caplog.records)) == (1, 1)


def test_rearmed_after_recovery() -> None:
    monitor = HitRateMonitor(threshold=0.5, window=2)
    low, good = MissReport(0, (COLD, COLD)), MissReport(4, ())
    monitor.observe(low)
    assert monitor.observe(low) is not None
    monitor.observe(good)
    monitor.observe(good)  # rate 1.0: armed again
    monitor.observe(low)
    assert monitor.observe(low) is not None
    assert monitor.warning_count == 2
    assert monitor.last_warning is not None and monitor.last_warning.reason is COLD


def test_threshold_zero_never_warns_and_short_prompts_do_not_count() -> None:
    monitor = HitRateMonitor(threshold=0.0, window=1)
    assert monitor.observe(MissReport(0, (COLD,))) is None
    assert monitor.hit_rate == 0.0
    fresh = HitRateMonitor(threshold=0.5, window=1)
    assert fresh.observe(MissReport(0, ())) is None
    assert fresh.hit_rate is None


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="threshold must be in"):
        HitRateMonitor(threshold=1.5)
    with pytest.raises(ValueError, match="window must be >= 1"):
        HitRateMonitor(window=0)
