"""The prefix cache across tiers: a RAM walk continued in the SSD index, then promotion.

```
 lookup(root, tokens, spans, namespace, expired_before)
   retention: expired RAM blocks the walk could reach are dropped first, expired SSD rows are
       misses (deleted after the walk); either is reported to ``on_expired``
   walk block by block: resident in RAM and verified?  else in the SSD index (or write queue),
       verified against the row (parent, tokens, extra keys, namespace)?  else stop
   tail candidates: RAM children and SSD children of the last matched block
   choose what a restore can use (recurrent models: only checkpointed lengths)
   promote the SSD blocks of that choice, in chain order: reserve their RAM bytes (refused:
       stop, a shorter hit), read + verify + decode (bad: quarantined, stop), insert into RAM
   -> PrefixHit of RAM blocks (the RAM lookup, now over the promoted blocks)
```

The walk reads only the index; files are read for the blocks the engine will use, never more
than the RAM budget can hold (blocks already matched are pinned while promoting, so making room
cannot evict the hit itself). Blocks still waiting in the write queue are served from memory.

Spilling is the other direction: the RAM cache's ``on_evict`` is ``SsdTier.spill``, and
``close`` writes every block still resident so a restarted server finds them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kv_cache.block import Block, Payload
from kv_cache.hashing import (
    BlockHash,
    ChainHasher,
    ExtraKey,
    ImageSpan,
    block_extra_keys,
    check_digest,
    token_array,
)
from kv_cache.payload import BlockPayload
from kv_cache.prefix_cache import PrefixCache, PrefixHit, tail_match
from kv_cache.retention import is_expired, purge_chain
from kv_cache.serialization import BlockMeta
from kv_cache.tiers.ssd import SsdTier
from kv_cache.tiers.ssd_index import RecordKind

# A step of the walk or a tail candidate: resident (Block) or on SSD (BlockMeta).
_Node = Block | BlockMeta


@dataclass(slots=True)
class TieredStats:
    """Counters of lookups through the tiers.

    Attributes:
        lookups: Calls to ``lookup``.
        ssd_lookups: Lookups that consulted the SSD tier (RAM alone did not reach the end).
        hits: Lookups whose hit includes at least one block promoted from SSD.
        misses: SSD lookups that used no SSD block.
        hit_blocks: SSD blocks chosen for promotion.
        promotions: Blocks promoted into RAM.
        promoted_bytes: RAM bytes of those blocks.
        promotion_failures: Promotions that failed (file gone, or corrupt and quarantined).
        budget_refusals: Promotions stopped because RAM could not make room.
        reload_seconds: Time spent promoting, over all lookups.
        last_reload_seconds: Time spent promoting in the last lookup that promoted.
        flushed: Blocks written at ``close``.
        expired_ram: Resident blocks a lookup found expired (dropped).
        expired_ssd: SSD blocks a lookup found expired (deleted).
    """

    lookups: int = 0
    ssd_lookups: int = 0
    hits: int = 0
    misses: int = 0
    hit_blocks: int = 0
    promotions: int = 0
    promoted_bytes: int = 0
    promotion_failures: int = 0
    budget_refusals: int = 0
    reload_seconds: float = 0.0
    last_reload_seconds: float = 0.0
    flushed: int = 0
    expired_ram: int = 0
    expired_ssd: int = 0


class NamespacedStore:
    """``insert_block`` of a prefix cache with a tenant namespace bound (for the harvester)."""

    __slots__ = ("_cache", "_namespace")

    def __init__(self, cache: PrefixCache, namespace: str) -> None:
        self._cache = cache
        self._namespace = namespace

    def insert_block(
        self,
        parent: BlockHash,
        tokens: Sequence[int] | np.ndarray,
        extra: tuple[ExtraKey, ...],
        payload: Payload | None,
        owner: str | None = None,
        *,
        partial: bool,
    ) -> Block | None:
        """``PrefixCache.insert_block`` recording the bound namespace on new blocks."""
        return self._cache.insert_block(
            parent, tokens, extra, payload, owner, partial=partial, namespace=self._namespace
        )


class TieredPrefixCache:
    """Lookups over RAM then SSD, promotion of SSD blocks into RAM.

    Args:
        ram: The RAM prefix cache (its ``on_evict`` should be ``ssd.spill``).
        ssd: The SSD tier, or None for RAM only.
        needs_checkpoint: Whether a hit length is restorable only where the block ending
            there carries a checkpoint (models with recurrent layers).
        on_expired: Told the hash of every block a lookup found expired (miss attribution).
    """

    def __init__(
        self,
        ram: PrefixCache,
        ssd: SsdTier | None,
        *,
        needs_checkpoint: bool,
        on_expired: Callable[[BlockHash], None] | None = None,
    ) -> None:
        self._ram = ram
        self._ssd = ssd
        self._needs_checkpoint = needs_checkpoint
        self._on_expired = on_expired
        # Of the lookup in progress: its retention cutoff, and the SSD blocks found expired.
        self._cutoff: float | None = None
        self._expired: dict[BlockHash, None] = {}
        self._closed = False
        self.stats = TieredStats()

    @property
    def ram(self) -> PrefixCache:
        return self._ram

    @property
    def ssd(self) -> SsdTier | None:
        return self._ssd

    def store_for(self, namespace: str) -> NamespacedStore:
        """The store the harvester of a request of tenant ``namespace`` inserts through."""
        return NamespacedStore(self._ram, namespace)

    def lookup(
        self,
        root: BlockHash,
        tokens: Sequence[int] | np.ndarray,
        spans: Sequence[ImageSpan],
        namespace: str,
        *,
        expired_before: float | None = None,
    ) -> PrefixHit:
        """Longest cached prefix over every tier; SSD blocks it uses are promoted into RAM.

        Args:
            root: Root digest of the (format, model, tenant).
            tokens: The prompt's token ids.
            spans: Image placeholder spans of the prompt.
            namespace: The tenant's storage namespace (SSD blocks of other namespaces are
                never used).
            expired_before: The tenant's retention cutoff (``now - retention``; None: no
                retention): blocks stored before it are never served, and are removed.

        Returns:
            A hit made only of resident blocks, as ``PrefixCache.lookup`` returns it.
        """
        self.stats.lookups += 1
        ssd = self._ssd
        if ssd is None and expired_before is None:
            return self._ram.lookup(root, tokens, spans)
        check_digest(root, "root")
        array = token_array(tokens)
        ids = tuple(array.tolist())
        size = self._ram.block_size
        limit = len(ids) - 1
        hasher = ChainHasher(root, array.tobytes(), spans, size)
        hashes = hasher.hashes(max(limit, 0) // size)
        if expired_before is not None:
            purged = purge_chain(self._ram, [root, *hashes], expired_before, self._on_expired)
            self.stats.expired_ram += purged.count
        if ssd is None:
            return self._ram.lookup(root, tokens, spans)
        pool = self._ram.pool
        self._cutoff = expired_before
        self._expired = {}

        steps: list[_Node] = []
        on_ssd: dict[BlockHash, BlockMeta] | None = None
        parent = root
        for index, digest in enumerate(hashes):
            window = ids[index * size : (index + 1) * size]
            extra = hasher.extra(index)
            block = pool.get(digest)
            if block is not None and _fits(block, parent, window, extra, False):
                steps.append(block)
            else:
                if on_ssd is None:
                    on_ssd = ssd.find_blocks(hashes[index:])
                meta = on_ssd.get(digest)
                if (
                    meta is None
                    or meta.namespace != namespace
                    or not _fits(meta, parent, window, extra, False)
                    or self._is_expired(meta)
                ):
                    break
                steps.append(meta)
            parent = digest

        fit = _fitting(steps, self._ram.ram.budget_bytes)
        if fit < len(steps):
            # The whole chain cannot be in RAM at once: use the longest prefix that can (the
            # resident blocks past it are not pinned, so promoting may evict them).
            steps = steps[:fit]
            tails: list[tuple[_Node, int]] = []
        else:
            start = len(steps) * size
            tails = self._tails(parent, ids, start, limit - start, spans, namespace)
        consulted = on_ssd is not None
        if consulted:
            self.stats.ssd_lookups += 1
        if self._needs_checkpoint:
            used, tail = self._restore_point(steps, tails, root, ids, spans, limit, namespace)
        else:
            used, tail = steps, (tails[0][0] if tails else None)
        if tail is not None and _fitting([*used, tail], self._ram.ram.budget_bytes) <= len(used):
            tail = None
        wanted = [node for node in used if isinstance(node, BlockMeta)]
        if isinstance(tail, BlockMeta):
            wanted.append(tail)
        promoted = 0
        if wanted:
            self.stats.hit_blocks += len(wanted)
            promoted = self._promote(used, tail, namespace)
        if promoted:
            self.stats.hits += 1
        elif consulted:
            self.stats.misses += 1
        if self._expired:
            self._drop_expired(list(self._expired))
        return self._ram.lookup(root, tokens, spans)

    def _is_expired(self, meta: BlockMeta) -> bool:
        """Whether an SSD block is past the current lookup's cutoff (then noted for deletion)."""
        if not is_expired(meta.stored_at, self._cutoff):
            return False
        self._expired[meta.block_hash] = None
        return True

    def _drop_expired(self, hashes: list[BlockHash]) -> None:
        assert self._ssd is not None
        self._expired = {}
        deleted = self._ssd.delete(RecordKind.KV, [bytes(h) for h in hashes])
        self.stats.expired_ssd += deleted.count
        if self._on_expired is not None:
            for digest in hashes:
                self._on_expired(digest)

    def _tails(
        self,
        parent: BlockHash,
        ids: tuple[int, ...],
        start: int,
        cap: int,
        spans: Sequence[ImageSpan],
        namespace: str,
    ) -> list[tuple[_Node, int]]:
        """Stored children of ``parent`` matching the request's next tokens, most tokens first
        (RAM before SSD on ties: no read needed)."""
        if cap <= 0:
            return []
        window = ids[start : start + self._ram.block_size]
        window_extra = block_extra_keys(start, len(window), spans) if spans else ()
        found: list[tuple[_Node, int]] = []
        for child in self._children(parent, namespace):
            matched = tail_match(child.tokens, child.extra, window, window_extra, cap)
            if matched:
                found.append((child, matched))
        found.sort(key=lambda item: (-item[1], isinstance(item[0], BlockMeta), _digest(item[0])))
        return found

    def _children(self, parent: BlockHash, namespace: str) -> list[_Node]:
        """Stored children of ``parent``: resident ones, then those only on SSD."""
        assert self._ssd is not None
        resident = self._ram.pool.children_of(parent)
        found: list[_Node] = list(resident.values())
        found.extend(
            meta
            for meta in self._ssd.children(parent)
            if meta.block_hash not in resident and meta.namespace == namespace and not self._is_expired(meta)
        )
        return found

    def _restore_point(
        self,
        steps: list[_Node],
        tails: list[tuple[_Node, int]],
        root: BlockHash,
        ids: tuple[int, ...],
        spans: Sequence[ImageSpan],
        limit: int,
        namespace: str,
    ) -> tuple[list[_Node], _Node | None]:
        """Recurrent models: the deepest checkpointed length, as ``plan_restore`` picks it
        (a checkpointed partial child at any depth of the chain, or a checkpointed block end),
        looked for in RAM and on SSD alike."""
        size = self._ram.block_size
        for k in range(len(steps), -1, -1):
            base = k * size
            if k == len(steps):
                points = [node for node, matched in tails if matched == len(node.tokens)]
            else:
                parent = _digest(steps[k - 1]) if k else root
                points = [
                    node
                    for node in self._children(parent, namespace)
                    if _is_partial(node)
                    and node.tokens == ids[base : base + len(node.tokens)]
                    and node.extra == block_extra_keys(base, len(node.tokens), spans)
                ]
            points = [
                node for node in points if _checkpointed(node) and base + len(node.tokens) <= limit
            ]
            if points:
                # Longest; a resident one on ties (no read).
                best = max(points, key=lambda node: (len(node.tokens), isinstance(node, Block)))
                return steps[:k], best
            if k and _checkpointed(steps[k - 1]) and base <= limit:
                return steps[:k], None
        return [], None

    def _promote(self, used: list[_Node], tail: _Node | None, namespace: str) -> int:
        """Bring the SSD nodes of ``used`` (+ ``tail``) into RAM in chain order; stops at the
        first that cannot be promoted. Returns the number promoted."""
        assert self._ssd is not None
        ram = self._ram
        began = time.perf_counter()
        nodes = used + ([tail] if tail is not None else [])
        # Pinned while promoting: making room for the promoted blocks must not evict the hit.
        ram.acquire([node for node in nodes if isinstance(node, Block)])
        promoted: dict[BlockHash, Block] = {}
        try:
            wanted = [node for node in nodes if isinstance(node, BlockMeta)]
            wanted = wanted[: self._reserve(wanted, namespace)]
            loads = self._ssd.load_blocks(wanted)
            try:
                for meta, payload in zip(wanted, loads):
                    block = self._insert(meta, payload, namespace)
                    if block is None:
                        break  # the chain is cut here: later blocks cannot be used
                    ram.acquire([block])
                    promoted[meta.block_hash] = block
            finally:
                loads.close()  # cancels the reads of blocks after a cut
        finally:
            chain = [
                node if isinstance(node, Block) else promoted.get(node.block_hash)
                for node in nodes
            ]
            # Chain order: release stamps the chain deepest block first.
            ram.release([block for block in chain if block is not None])
        elapsed = time.perf_counter() - began
        self.stats.reload_seconds += elapsed
        self.stats.last_reload_seconds = elapsed
        return len(promoted)

    def _reserve(self, wanted: list[BlockMeta], namespace: str) -> int:
        """Make RAM room for the longest prefix of ``wanted`` that can have it, before any file
        is read (never over budget). Returns that prefix's length."""
        totals = list(itertools.accumulate(meta.nbytes for meta in wanted))
        count = len(wanted)
        while count and not self._ram.ram.reserve(totals[count - 1], namespace):
            count -= 1
        if count < len(wanted):
            self.stats.budget_refusals += 1
        return count

    def _insert(self, meta: BlockMeta, payload: BlockPayload | None, namespace: str) -> Block | None:
        if payload is None:
            self.stats.promotion_failures += 1
            return None
        # Room is reserved, so the insert neither evicts nor refuses (no write back to SSD).
        block = self._ram.insert_block(
            meta.parent, meta.tokens, meta.extra, payload, None, partial=meta.partial,
            namespace=namespace, stored_at=meta.stored_at,
        )
        if block is None or block.block_hash != meta.block_hash:
            # A hash collision in RAM, or a covering partial stands in for it: not this block.
            self.stats.promotion_failures += 1
            return None
        for owner in meta.owners:
            self._ram.pool.add_owner(block, owner)
        self.stats.promotions += 1
        self.stats.promoted_bytes += meta.nbytes
        return block

    def close(self) -> None:
        """Write the resident blocks to SSD, then close the SSD tier (idempotent; no lookup may
        follow).

        Oldest first, so the SSD's LRU order follows RAM's; blocks so old that the newer ones
        alone fill the SSD budget are skipped (they would be written only to be deleted).
        """
        if self._ssd is None or self._closed:
            return
        self._closed = True
        pool = self._ram.pool
        blocks = list(pool.free_blocks()) + [b for b in pool if b.ref_count]
        room = self._ssd.budget_bytes
        first = len(blocks)
        while first > 0 and blocks[first - 1].nbytes <= room:
            first -= 1
            room -= blocks[first].nbytes
        for block in blocks[first:]:
            if self._ssd.spill(block, wait=True):
                self.stats.flushed += 1
        self._ssd.close()


def _fits(
    node: _Node, parent: BlockHash, window: tuple[int, ...], extra: tuple[ExtraKey, ...], partial: bool
) -> bool:
    """A stored node is the request's block here: same parent, tokens, image keys (a hash
    match alone is never trusted)."""
    return (
        _is_partial(node) == partial
        and node.parent == parent
        and node.extra == extra
        and node.tokens == window
    )


def _fitting(nodes: Sequence[_Node], budget: int) -> int:
    """How many leading nodes fit in ``budget`` bytes together."""
    total = 0
    for count, node in enumerate(nodes):
        total += node.nbytes
        if total > budget:
            return count
    return len(nodes)


def _is_partial(node: _Node) -> bool:
    return node.is_partial if isinstance(node, Block) else node.partial


def _checkpointed(node: _Node) -> bool:
    if isinstance(node, Block):
        return bool(getattr(node.payload, "checkpointed", False))
    return node.checkpointed


def _digest(node: _Node) -> bytes:
    return node.block_hash
