"""A count of cache entries with their bytes: what an erasure, a sweep or a quota removed."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Tally:
    """Entries and the bytes they held.

    Attributes:
        count: Number of entries (blocks, features, files).
        nbytes: Their bytes (RAM bytes for RAM tiers, file bytes for the SSD tier).
    """

    count: int = 0
    nbytes: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.count + other.count, self.nbytes + other.nbytes)

    @classmethod
    def of(cls, sizes: Iterable[int]) -> Tally:
        """The tally of entries of these sizes."""
        count = total = 0
        for size in sizes:
            count += 1
            total += size
        return cls(count, total)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "bytes": self.nbytes}
