"""Erasure of a session's (or a whole tenant's) KV blocks from RAM and the SSD tier.

A block lists as owners the sessions that produced it or reused it. Erasing session S of a
tenant removes every block of the tenant whose owners, over all its copies (RAM, SSD), are S
alone; a block another session of the tenant also owns (a shared system prompt, a common
history) stays, with S struck from its owners. Blocks stored without a session are never
erased by session erasure, only with their tenant.

The SSD writer's queue is written out first (``SsdTier.delete`` flushes it), so no block of the
session lands on disk after the erasure returns. The caller compacts the index afterwards
(``SsdTier.compact``) so that no page of it keeps a deleted key.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.block import Block
from kv_cache.hashing import BlockHash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tally import Tally
from kv_cache.tiers.ssd import SsdTier
from kv_cache.tiers.ssd_index import RecordKind
from kv_cache.tiers.ssd_maintenance import split_owned


@dataclass(frozen=True, slots=True)
class KvErasure:
    """What an erasure removed from the KV tiers.

    Attributes:
        ram: Resident blocks removed and their RAM bytes.
        ssd: Block files removed and their file bytes.
        kept_shared: Blocks of the session kept because another session owns them too.
    """

    ram: Tally = Tally()
    ssd: Tally = Tally()
    kept_shared: int = 0


def erase_owner(cache: PrefixCache, ssd: SsdTier | None, namespace: str, owner: str) -> KvErasure:
    """Erase the blocks session ``owner`` of tenant ``namespace`` alone owns, in every tier.

    Call on the engine thread between requests (no block may be pinned by a running request).

    Returns:
        What was removed, per tier, and how many shared blocks were kept.
    """
    if ssd is not None:
        ssd.flush()  # queued blocks become rows: nothing of the session lands afterwards
    resident: dict[BlockHash, Block] = {
        block.block_hash: block for block in cache.pool.owned_by(owner) if block.namespace == namespace
    }
    stored: dict[BlockHash, tuple[str, ...]] = {}
    if ssd is not None:
        stored = {
            BlockHash(row.key): row.owners
            for row in ssd.owned_rows(namespace, owner)
            if row.kind is RecordKind.KV
        }
        # Copies that do not list the owner still count: their owners keep the block alive.
        for digest, meta in ssd.find_blocks([h for h in resident if h not in stored]).items():
            if meta.namespace == namespace:
                stored[digest] = meta.owners
    for digest in [h for h in stored if h not in resident]:
        block = cache.pool.get(digest)
        if block is not None and block.namespace == namespace:
            resident[digest] = block
    holdings = [(h, block.owners) for h, block in resident.items()]
    holdings += [(h, owners) for h, owners in stored.items()]
    doomed, shared = split_owned(owner, holdings)

    gone = [resident[h] for h in sorted(doomed) if h in resident]
    for block in gone:
        cache.discard(block)
    # Shared blocks: every copy lists exactly the other owners (a copy that missed one learns it).
    for digest, others in shared.items():
        block = resident.get(digest)
        if block is not None:
            cache.pool.discard_owner(block, owner)
            for other in others - block.owners:
                cache.pool.add_owner(block, other)
    on_disk = Tally()
    if ssd is not None:
        on_disk = ssd.delete(RecordKind.KV, [bytes(h) for h in sorted(doomed) if h in stored])
        for digest in sorted(shared):
            owners = stored.get(digest)
            if owners is not None and set(owners) != shared[digest]:
                ssd.set_owners(RecordKind.KV, bytes(digest), sorted(shared[digest]))
    return KvErasure(Tally.of(block.nbytes for block in gone), on_disk, len(shared))


def erase_resident_namespace(cache: PrefixCache, namespace: str) -> Tally:
    """Drop every resident block of a tenant (no spill). The SSD side is
    ``SsdTier.erase_namespace`` (every record kind at once).

    Returns:
        The blocks removed and their RAM bytes.
    """
    gone = [block for block in cache.pool if block.namespace == namespace]
    for block in gone:
        cache.discard(block)
    return Tally.of(block.nbytes for block in gone)
