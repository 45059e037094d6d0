"""Time to live of KV blocks in RAM: an expired block is never served and is dropped.

A tenant's retention counts from ``stored_at``, when a block's content was first computed
(kept when a lower tier hands the block back), not from its last use: with a retention of R
seconds no state of the tenant older than R is served or kept, however often it is reused.
Expiry is checked twice: on read (``purge_chain`` drops the expired blocks a lookup could reach
before it walks, so even a block the sweeper has not reached yet is a miss) and by the periodic
sweep (``sweep``), which drops every expired block. Expired blocks are not spilled to a lower
tier: they must not outlive their time there either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kv_cache.block import Block
from kv_cache.hashing import BlockHash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tally import Tally

ExpiredHook = Callable[[BlockHash], None]


def is_expired(stored_at: float | None, cutoff: float | None) -> bool:
    """Whether content stored at ``stored_at`` is past ``cutoff`` (stored strictly before it).

    Args:
        stored_at: Wall-clock seconds of the content's first computation; None when unknown
            (a block built outside a cache: never expired here, its tier stamps it).
        cutoff: ``now - retention``; None when the tenant has no retention.
    """
    return cutoff is not None and stored_at is not None and stored_at < cutoff


def purge_chain(
    cache: PrefixCache,
    parents: Iterable[BlockHash],
    cutoff: float | None,
    on_expired: ExpiredHook | None = None,
) -> Tally:
    """Expire the resident children of each of ``parents`` stored before ``cutoff``.

    Called with a request's root and chain hashes before its lookup, it removes every expired
    block the lookup could match (chain blocks, tail candidates, restore points).

    Returns:
        The blocks expired and their bytes.
    """
    if cutoff is None:
        return Tally()
    expired: dict[BlockHash, Block] = {}
    for parent in parents:
        for child in cache.pool.children_of(parent).values():
            if is_expired(child.stored_at, cutoff):
                expired[child.block_hash] = child
    return _expire(cache, list(expired.values()), on_expired)


def sweep(
    cache: PrefixCache, cutoffs: Mapping[str, float], on_expired: ExpiredHook | None = None
) -> Tally:
    """Expire every resident block of a namespace in ``cutoffs`` stored before its cutoff.

    Args:
        cache: The RAM prefix cache.
        cutoffs: ``now - retention`` per tenant namespace with a retention.
        on_expired: Told each expired block's hash (miss attribution).

    Returns:
        The blocks expired and their bytes.
    """
    if not cutoffs:
        return Tally()
    expired = [
        block
        for block in cache.pool
        if block.namespace is not None and is_expired(block.stored_at, cutoffs.get(block.namespace))
    ]
    return _expire(cache, expired, on_expired)


def _expire(cache: PrefixCache, blocks: list[Block], on_expired: ExpiredHook | None) -> Tally:
    tally = Tally.of(block.nbytes for block in blocks)
    for block in blocks:
        cache.expire(block)
        if on_expired is not None:
            on_expired(block.block_hash)
    return tally
