"""Stop strings applied to streamed text.

Text that could be the beginning of a stop string is held back until the next piece shows
whether it is one, so a client never sees part of a stop string. The text before the earliest
stop string is released and generation should then be cancelled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopScan:
    """Result of feeding one piece of text.

    Attributes:
        text: text safe to send to the client now.
        stopped: a stop string was found; ``text`` ends right before it.
    """

    text: str
    stopped: bool


class StopMatcher:
    """Finds the earliest stop string in text that arrives piece by piece."""

    __slots__ = ("_stops", "_held", "_stopped")

    def __init__(self, stops: Iterable[str]) -> None:
        # An empty stop string would match before any text: OpenAI ignores it, so do we.
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._held = ""
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, text: str) -> StopScan:
        """Add the next piece of generated text.

        Raises:
            RuntimeError: called again after a stop string was found.
        """
        if self._stopped:
            raise RuntimeError("StopMatcher.feed after a stop string was found")
        if not self._stops:
            return StopScan(text, False)
        buffer = self._held + text
        # Released text never holds the start of a stop string, so any occurrence lies in
        # `buffer`; the earliest one wins.
        found = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if found:
            self._held = ""
            self._stopped = True
            return StopScan(buffer[: min(found)], True)
        hold = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - hold:]
        return StopScan(buffer[: len(buffer) - hold], False)

    def flush(self) -> str:
        """Release held text at the end of generation (it turned out not to be a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = min(len(buffer), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
