"""The prefix cache across tiers: a RAM walk continued in the SSD index, then promotion.

```
 lookup(root, tokens, spans, namespace)
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

import time
from collections.abc import Sequence
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
from kv_cache.prefix_cache import PrefixCache, PrefixHit, tail_match
from kv_cache.serialization import BlockMeta
from kv_cache.tiers.ssd import SsdTier

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
    """

    def __init__(self, ram: PrefixCache, ssd: SsdTier | None, *, needs_checkpoint: bool) -> None:
        self._ram = ram
        self._ssd = ssd
        self._needs_checkpoint = needs_checkpoint
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
    ) -> PrefixHit:
        """Longest cached prefix over every tier; SSD blocks it uses are promoted into RAM.

        Args:
            root: Root digest of the (format, model, tenant).
            tokens: The prompt's token ids.
            spans: Image placeholder spans of the prompt.
            namespace: The tenant's storage namespace (SSD blocks of other namespaces are
                never used).

        Returns:
            A hit made only of resident blocks, as ``PrefixCache.lookup`` returns it.
        """
        self.stats.lookups += 1
        ssd = self._ssd
        if ssd is None:
            return self._ram.lookup(root, tokens, spans)
        check_digest(root, "root")
        array = token_array(tokens)
        ids = tuple(array.tolist())
        size = self._ram.block_size
        limit = len(ids) - 1
        hasher = ChainHasher(root, array.tobytes(), spans, size)
        hashes = hasher.hashes(max(limit, 0) // size)
        pool = self._ram.pool

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
                if meta is None or meta.namespace != namespace or not _fits(meta, parent, window, extra, False):
                    break
                steps.append(meta)
            parent = digest

        start = len(steps) * size
        tails = self._tails(parent, ids, start, limit - start, spans, namespace)
        if on_ssd is None and not any(isinstance(node, BlockMeta) for node, _ in tails):
            # RAM reached the end of the walk and no tail is on SSD: nothing to promote.
            if tails or len(steps) == len(hashes):
                return self._ram.lookup(root, tokens, spans)
        self.stats.ssd_lookups += 1
        used, tail = self._choose(steps, tails)
        wanted = [node for node in used if isinstance(node, BlockMeta)]
        if isinstance(tail, BlockMeta):
            wanted.append(tail)
        if not wanted:
            self.stats.misses += 1
            return self._ram.lookup(root, tokens, spans)
        self.stats.hit_blocks += len(wanted)
        promoted = self._promote(used, tail, namespace)
        if promoted:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return self._ram.lookup(root, tokens, spans)

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
        assert self._ssd is not None
        window = ids[start : start + self._ram.block_size]
        window_extra = block_extra_keys(start, len(window), spans) if spans else ()
        found: list[tuple[_Node, int]] = []
        resident = self._ram.pool.children_of(parent)
        for child in resident.values():
            matched = tail_match(child.tokens, child.extra, window, window_extra, cap)
            if matched:
                found.append((child, matched))
        for meta in self._ssd.children(parent):
            if meta.block_hash in resident or meta.namespace != namespace:
                continue
            matched = tail_match(meta.tokens, meta.extra, window, window_extra, cap)
            if matched:
                found.append((meta, matched))
        found.sort(key=lambda item: (-item[1], isinstance(item[0], BlockMeta), _digest(item[0])))
        return found

    def _choose(
        self, steps: list[_Node], tails: list[tuple[_Node, int]]
    ) -> tuple[list[_Node], _Node | None]:
        """The chain prefix and tail a restore can use (what ``plan_restore`` will pick)."""
        if not self._needs_checkpoint:
            return steps, tails[0][0] if tails else None
        for node, matched in tails:
            if matched == len(node.tokens) and _checkpointed(node):
                return steps, node
        last = max((k + 1 for k, node in enumerate(steps) if _checkpointed(node)), default=0)
        return steps[:last], None

    def _promote(self, used: list[_Node], tail: _Node | None, namespace: str) -> int:
        """Bring the SSD nodes of ``used`` (+ ``tail``) into RAM in chain order; stops at the
        first that cannot be promoted. Returns the number promoted."""
        assert self._ssd is not None
        ram = self._ram
        began = time.perf_counter()
        pinned: list[Block] = [node for node in used if isinstance(node, Block)]
        if isinstance(tail, Block):
            pinned.append(tail)
        ram.acquire(pinned)
        promoted = 0
        promoted_hashes: list[BlockHash] = []
        try:
            chain_done = True
            for node in used:
                if isinstance(node, BlockMeta):
                    block = self._promote_one(node, namespace)
                    if block is None:
                        chain_done = False
                        break
                    ram.acquire([block])
                    pinned.append(block)
                    promoted += 1
                    promoted_hashes.append(node.block_hash)
            if chain_done and isinstance(tail, BlockMeta):
                block = self._promote_one(tail, namespace)
                if block is not None:
                    ram.acquire([block])
                    pinned.append(block)
                    promoted += 1
                    promoted_hashes.append(tail.block_hash)
        finally:
            # Chain order (the tail last): release stamps them deepest first.
            order = {id(node): k for k, node in enumerate(used)}
            pinned.sort(key=lambda b: order.get(id(b), len(used) + 1))
            ram.release(pinned)
        elapsed = time.perf_counter() - began
        self.stats.reload_seconds += elapsed
        self.stats.last_reload_seconds = elapsed
        return promoted

    def _promote_one(self, meta: BlockMeta, namespace: str) -> Block | None:
        assert self._ssd is not None
        ram = self._ram
        if not ram.ram.reserve(meta.nbytes):
            self.stats.budget_refusals += 1
            return None
        payload = self._ssd.load_block(meta)
        if payload is None:
            self.stats.promotion_failures += 1
            return None
        # Room is reserved, so the insert neither evicts nor refuses (no write back to SSD).
        block = ram.insert_block(
            meta.parent, meta.tokens, meta.extra, payload, None, partial=meta.partial, namespace=namespace
        )
        if block is None or block.block_hash != meta.block_hash:
            # A hash collision in RAM, or a covering partial stands in for it: not this block.
            self.stats.promotion_failures += 1
            return None
        for owner in meta.owners:
            ram.pool.add_owner(block, owner)
        self.stats.promotions += 1
        self.stats.promoted_bytes += meta.nbytes
        return block

    def close(self) -> None:
        """Write every resident block to SSD (oldest first), then close the SSD tier."""
        if self._ssd is None:
            return
        for block in list(self._ram.pool.free_blocks()) + [
            b for b in self._ram.pool if b.ref_count
        ]:
            if self._ssd.spill(block, wait=True):
                self.stats.flushed += 1
        self._ssd.close()


def _fits(
    node: _Node, parent: BlockHash, window: tuple[int, ...], extra: tuple[ExtraKey, ...], partial: bool
) -> bool:
    """A stored node is the request's block here: same parent, tokens, image keys (a hash
    match alone is never trusted)."""
    is_partial = node.is_partial if isinstance(node, Block) else node.partial
    return (
        is_partial == partial
        and node.parent == parent
        and node.extra == extra
        and node.tokens == window
    )


def _checkpointed(node: _Node) -> bool:
    if isinstance(node, Block):
        return bool(getattr(node.payload, "checkpointed", False))
    return node.checkpointed


def _digest(node: _Node) -> bytes:
    return node.block_hash
