"""Token-granular matching of a stored block against a request's next tokens (the tail rule of
``PrefixCache.lookup``, shared by the lower tiers and miss attribution), and the keys helpers
it needs."""

from __future__ import annotations

from kv_cache.block import Payload
from kv_cache.hashing import ExtraKey


def tail_match(
    stored: tuple[int, ...],
    stored_extra: tuple[ExtraKey, ...],
    window: tuple[int, ...],
    window_extra: tuple[ExtraKey, ...],
    cap: int,
) -> int:
    """Tokens of a stored block usable as the tail of a request (the ``lookup`` tail rule).

    Lower tiers match their own stored children with the same rule as RAM.

    Args:
        stored: The stored block's tokens.
        stored_extra: Its extra keys.
        window: The request's next tokens (at most one block).
        window_extra: Extra keys of ``window`` (``block_extra_keys`` with its length).
        cap: Most tokens that may match.

    Returns:
        The longest common prefix of ``stored`` and ``window`` (at most ``cap``), cut where
        the image keys first disagree.
    """
    matched = _common_prefix(stored, window, cap)
    if matched and (stored_extra or window_extra):
        matched = _agreeing_prefix(stored_extra, window_extra, matched)
    return matched


def checkpointed(payload: Payload | None) -> bool:
    """Whether a payload is a restore point of its own (``payload.checkpointed``).

    Recurrent state can be restored only at the exact length a checkpoint was taken, so a
    covering block (without a checkpoint at that length) does not make such a partial redundant.
    """
    return bool(getattr(payload, "checkpointed", False))


def _common_prefix(stored: tuple[int, ...], window: tuple[int, ...], cap: int) -> int:
    limit = min(len(stored), len(window), cap)
    if stored[:limit] == window[:limit]:
        return limit
    for index in range(limit):
        if stored[index] != window[index]:
            return index
    raise AssertionError("unreachable: slices differ but no element does")


def keys_before(extra: tuple[ExtraKey, ...], count: int) -> tuple[ExtraKey, ...]:
    """Keys of the images overlapping the first ``count`` tokens of a block.

    Every key of a block belongs to a span ending after the block's start, so the span
    overlaps the first ``count`` tokens exactly when its offset is below ``count``.
    """
    return tuple(key for key in extra if key[1] < count)


def _agreeing_prefix(
    stored: tuple[ExtraKey, ...], requested: tuple[ExtraKey, ...], matched: int
) -> int:
    """Shrink a token match to where the image keys agree.

    Tokens before a disagreeing image's first placeholder do not depend on that image
    (causal attention), so the match ends at the lowest offset of a differing key.
    """
    while matched > 0:
        ours = keys_before(stored, matched)
        theirs = keys_before(requested, matched)
        if ours == theirs:
            return matched
        index = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        offsets = [keys[index][1] for keys in (ours, theirs) if index < len(keys)]
        matched = max(0, min(offsets))
    return 0
