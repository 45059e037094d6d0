"""RAM tier: a byte budget shared by every in-memory cache, with LRU eviction across them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import psutil

DEFAULT_RAM_FRACTION = 0.20
MIN_RAM_BUDGET = 100 * 1024 * 1024


def default_ram_budget() -> int:
    """20% of the RAM available now, but at least 100 MiB."""
    return max(int(psutil.virtual_memory().available * DEFAULT_RAM_FRACTION), MIN_RAM_BUDGET)


class Evictor(Protocol):
    """A cache holding bytes charged to a ``RamTier`` that can give them back, oldest first."""

    def oldest_access(self) -> int | None:
        """Clock stamp of the entry that would be evicted next, or None if none can be."""
        ...

    def evict_oldest(self) -> int:
        """Evict that entry (discharging its bytes from the tier); returns the bytes freed."""
        ...


@dataclass(slots=True)
class RamStats:
    """Budget-level counters.

    Attributes:
        evictions: Entries evicted to make room.
        evicted_bytes: Bytes freed by those evictions.
        failed_reserves: Reservations refused because referenced entries fill the budget
            (or the request exceeds the whole budget).
    """

    evictions: int = 0
    evicted_bytes: int = 0
    failed_reserves: int = 0


class RamTier:
    """Byte accounting for resident cache entries.

    Caches charge the bytes of what they admit and discharge what they drop. ``reserve`` makes
    room by evicting, from whichever registered evictor holds it, the least recently used
    unreferenced entry, using this tier's shared clock so ages compare across caches.

    Args:
        budget_bytes: Byte budget; None means ``default_ram_budget()``.
    """

    __slots__ = ("_budget", "_used", "_evictors", "_clock", "stats")

    def __init__(self, budget_bytes: int | None = None) -> None:
        self._budget = default_ram_budget() if budget_bytes is None else _check_budget(budget_bytes)
        self._used = 0
        self._evictors: list[Evictor] = []
        self._clock = itertools.count(1)
        self.stats = RamStats()

    @property
    def budget_bytes(self) -> int:
        """The byte budget."""
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Bytes currently charged (resident, or held by users of dropped entries)."""
        return self._used

    @property
    def free_bytes(self) -> int:
        """Budget not charged (negative after the budget shrank below use)."""
        return self._budget - self._used

    def tick(self) -> int:
        """Next access stamp of the shared LRU clock."""
        return next(self._clock)

    def register(self, evictor: Evictor) -> None:
        """Let ``reserve`` evict from ``evictor``."""
        if any(known is evictor for known in self._evictors):
            raise ValueError(f"evictor {evictor!r} is already registered")
        self._evictors.append(evictor)

    def set_budget(self, budget_bytes: int) -> bool:
        """Change the budget, evicting until use fits.

        Returns:
            False when referenced entries keep use above the new budget.
        """
        self._budget = _check_budget(budget_bytes)
        return self.reserve(0)

    def reserve(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` more by evicting LRU entries; charges nothing.

        Returns:
            True when ``used_bytes + nbytes`` now fits the budget; False when it cannot (the
            rest is referenced, or ``nbytes`` exceeds the budget, in which case nothing is
            evicted).
        """
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative size: {nbytes}")
        if nbytes > self._budget:
            self.stats.failed_reserves += 1
            return False
        while self._used + nbytes > self._budget:
            victim = self._oldest_evictor()
            if victim is None:
                self.stats.failed_reserves += 1
                return False
            before = self._used
            freed = victim.evict_oldest()
            assert self._used == before - freed, "evictor must discharge what it frees"
            self.stats.evictions += 1
            self.stats.evicted_bytes += freed
        return True

    def charge(self, nbytes: int) -> None:
        """Account ``nbytes`` newly held (call ``reserve`` first to stay within budget)."""
        if nbytes < 0:
            raise ValueError(f"cannot charge a negative size: {nbytes}")
        self._used += nbytes

    def discharge(self, nbytes: int) -> None:
        """Account ``nbytes`` no longer held."""
        if not 0 <= nbytes <= self._used:
            raise ValueError(f"cannot discharge {nbytes} bytes with {self._used} charged")
        self._used -= nbytes

    def _oldest_evictor(self) -> Evictor | None:
        best: Evictor | None = None
        best_age = 0
        for evictor in self._evictors:
            age = evictor.oldest_access()
            if age is not None and (best is None or age < best_age):
                best, best_age = evictor, age
        return best


def _check_budget(budget_bytes: int) -> int:
    if budget_bytes < 0:
        raise ValueError(f"RAM budget must be >= 0 bytes, got {budget_bytes}")
    return budget_bytes
