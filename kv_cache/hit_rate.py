"""Rolling prefix-cache hit rate with one actionable warning when it drops.

The rate is over full blocks (the unit the cache serves): matched blocks / (matched + missed)
over the last ``window`` lookups that had any reusable block. When a full window's rate falls
below the threshold, one warning names the dominant miss reason and what to do about it; the
warning is armed again only after the rate has recovered to the threshold, so a persistently
bad workload logs once, not once per request.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from kv_cache.miss_reasons import MissReason, MissReport

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.2
DEFAULT_WINDOW = 50

# What an operator can do about each dominant reason.
SUGGESTIONS: Mapping[MissReason, str] = {
    MissReason.EVICTED: "raise --ram-budget (or give the SSD tier more room) so blocks stay "
                        "until they are reused",
    MissReason.EXPIRED: "raise the tenants' retention_seconds in the keys file: blocks expire "
                        "before they are reused",
    MissReason.DIVERGED: "clients send back a different history than the one cached (edited or "
                         "re-rendered assistant replies, another image in the same place): send "
                         "replies back verbatim and keep the message order",
    MissReason.ISOLATED: "the same prompts arrive under different tenants (API keys) and tenant "
                         "caches never share; give clients that may share state one tenant",
    MissReason.COLD: "most prompts are new content; put the stable parts (system prompt, tools, "
                     "shared images) first and keep them byte-identical across requests",
}


@dataclass(frozen=True, slots=True)
class HitRateWarning:
    """The warning that was logged.

    Attributes:
        hit_rate: Block hit rate over the window.
        reason: Dominant miss reason in the window.
        share: Fraction of the window's missed blocks with that reason.
        message: The logged text.
    """

    hit_rate: float
    reason: MissReason
    share: float
    message: str


class HitRateMonitor:
    """Tracks the rolling block hit rate and warns once per low episode.

    Args:
        threshold: Warn when the window's hit rate is below this (0 disables).
        window: Lookups in the rolling window; the rate is judged only on a full window.
    """

    __slots__ = ("_threshold", "_window", "_reports", "_hit", "_asked", "_armed", "last_warning",
                 "warning_count")

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, window: int = DEFAULT_WINDOW) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"hit-rate threshold must be in [0, 1], got {threshold}")
        if window < 1:
            raise ValueError(f"hit-rate window must be >= 1 lookups, got {window}")
        self._threshold = threshold
        self._window = window
        self._reports: deque[MissReport] = deque()
        # Running sums over the window: ``hit_rate`` is read from other threads (metrics
        # scrapes) and must not iterate the deque while the engine thread appends to it.
        self._hit = 0
        self._asked = 0
        self._armed = True
        self.last_warning: HitRateWarning | None = None
        self.warning_count = 0

    @property
    def threshold(self) -> float:
        return self._threshold

    @property
    def hit_rate(self) -> float | None:
        """Block hit rate over the lookups in the window; None before any block was asked."""
        hit, asked = self._hit, self._asked
        return hit / asked if asked else None

    def observe(self, report: MissReport) -> HitRateWarning | None:
        """Add one lookup's report; returns the warning if this observation logged one."""
        if report.hit_blocks + report.missed_blocks == 0:
            return None  # prompt shorter than a block: nothing a cache could serve
        self._reports.append(report)
        self._hit += report.hit_blocks
        self._asked += report.hit_blocks + report.missed_blocks
        if len(self._reports) > self._window:
            old = self._reports.popleft()
            self._hit -= old.hit_blocks
            self._asked -= old.hit_blocks + old.missed_blocks
        rate = self.hit_rate
        assert rate is not None
        if rate >= self._threshold:
            self._armed = True
            return None
        if not self._armed or len(self._reports) < self._window:
            return None
        self._armed = False
        warning = self._warning(rate)
        log.warning("%s", warning.message)
        self.last_warning = warning
        self.warning_count += 1
        return warning

    def _warning(self, rate: float) -> HitRateWarning:
        counts = {reason: 0 for reason in MissReason}
        for report in self._reports:
            for reason in report.reasons:
                counts[reason] += 1
        missed = sum(counts.values())
        # Ties go to the reason listed first in MissReason (deterministic).
        reason = max(MissReason, key=lambda r: counts[r])
        share = counts[reason] / missed if missed else 0.0
        message = (
            f"prefix cache hit rate over the last {len(self._reports)} requests is {rate:.0%} "
            f"(warning threshold {self._threshold:.0%}); {share:.0%} of missed blocks were "
            f"{reason.value}: {SUGGESTIONS[reason]}"
        )
        return HitRateWarning(rate, reason, share, message)
