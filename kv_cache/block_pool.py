"""Resident blocks: hash map, child links, reference counts, owners and the LRU free queue.

The pool is pure structure: it knows nothing of hashing, budgets or spilling (see
``prefix_cache``). Children are linked to their parent block when it is resident; children
whose parent is not resident (block 0 under a root, or blocks whose parent was evicted) are
kept in a "detached" index under the parent's hash, and adopted by the parent when it is added
again (for instance promoted back from SSD). So ``children_of`` works the same for roots and
for blocks, and evicting a parent never loses its children.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from kv_cache.block import Block
from kv_cache.free_queue import FreeQueue
from kv_cache.hashing import BlockHash

_EMPTY: Mapping[BlockHash, Block] = MappingProxyType({})


class BlockPool:
    """Resident blocks by hash, with O(1) LRU over the unreferenced ones.

    Unreferenced blocks wait in one LRU queue per tenant namespace, so the oldest block of one
    tenant (quota eviction) is as cheap to find as the oldest of all (the oldest of the queue
    heads, one per tenant). Every queue is in access-stamp order, so merging them by stamp
    gives the global LRU order.

    Args:
        clock: Returns a strictly increasing access stamp on each call; share one clock
            between all users of a RAM budget so their ages compare.
    """

    __slots__ = ("_blocks", "_detached", "_free", "_by_owner", "_clock")

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        self._blocks: dict[BlockHash, Block] = {}
        self._detached: dict[BlockHash, dict[BlockHash, Block]] = {}
        self._free: dict[str | None, FreeQueue] = {}
        self._by_owner: dict[str, set[Block]] = {}
        self._clock = clock if clock is not None else itertools.count(1).__next__

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks.values())

    @property
    def free_count(self) -> int:
        """Number of unreferenced (evictable) blocks."""
        return sum(len(queue) for queue in self._free.values())

    def get(self, block_hash: BlockHash) -> Block | None:
        """The resident block with this hash, or None."""
        return self._blocks.get(block_hash)

    def children_of(self, parent: BlockHash) -> Mapping[BlockHash, Block]:
        """Stored children (full and partial) of a block or root, by hash. Do not mutate."""
        block = self._blocks.get(parent)
        if block is not None:
            return block.children
        return self._detached.get(parent, _EMPTY)

    def free_blocks(self) -> Iterator[Block]:
        """Unreferenced blocks, least recently used first."""
        queues = list(self._free.values())
        if len(queues) == 1:
            return iter(queues[0])
        return heapq.merge(*queues, key=lambda block: block.last_access)

    def free_blocks_of(self, namespace: str | None) -> Iterator[Block]:
        """Unreferenced blocks of one namespace, least recently used first."""
        queue = self._free.get(namespace)
        return iter(queue) if queue is not None else iter(())

    def free_namespaces(self) -> list[str | None]:
        """Namespaces that have unreferenced blocks."""
        return [ns for ns, queue in self._free.items() if len(queue)]

    def owned_by(self, owner: str) -> frozenset[Block]:
        """Resident blocks that list ``owner``."""
        return frozenset(self._by_owner.get(owner, ()))

    def add(self, block: Block) -> None:
        """Make a new block resident.

        It becomes the most recently used block, except under an unreferenced parent: then it
        takes the parent's age and goes just before it, so that a parent never ages out
        before its child.
        """
        if block.block_hash in self._blocks:
            raise ValueError(f"block {block.block_hash.hex()} is already resident")
        if block.resident or block.children or block.prev_free is not None:
            raise ValueError(f"block {block.block_hash.hex()} is not a fresh block")
        self._blocks[block.block_hash] = block
        block.resident = True
        parent = self._blocks.get(block.parent)
        if parent is not None:
            parent.children[block.block_hash] = block
        else:
            self._detached.setdefault(block.parent, {})[block.block_hash] = block
        orphans = self._detached.pop(block.block_hash, None)
        if orphans is not None:
            block.children = orphans
        for owner in block.owners:
            self._by_owner.setdefault(owner, set()).add(block)
        if (
            block.ref_count == 0
            and parent is not None
            and parent.prev_free is not None
            and parent.namespace == block.namespace
        ):
            # Harvesting a chain block by block adds each block under the one before: placing
            # it just ahead of its parent keeps the chain aging deepest first, in O(1).
            block.last_access = parent.last_access
            self._queue(block).insert_before(parent, block)
            return
        block.last_access = self._clock()
        if block.ref_count == 0:
            self._queue(block).append(block)

    def remove(self, block: Block) -> None:
        """Make a resident block non-resident; its children stay, detached.

        A referenced block may be removed (it is superseded or discarded while in use): it
        leaves the map at once and its user keeps the object until release.
        """
        if self._blocks.get(block.block_hash) is not block:
            raise ValueError(f"block {block.block_hash.hex()} is not resident")
        del self._blocks[block.block_hash]
        block.resident = False
        parent = self._blocks.get(block.parent)
        if parent is not None:
            del parent.children[block.block_hash]
        else:
            siblings = self._detached[block.parent]
            del siblings[block.block_hash]
            if not siblings:
                del self._detached[block.parent]
        if block.children:
            self._detached[block.block_hash] = block.children
            block.children = {}
        for owner in block.owners:
            owned = self._by_owner[owner]
            owned.discard(block)
            if not owned:
                del self._by_owner[owner]
        if block.prev_free is not None:
            self._queue(block).remove(block)

    def add_owner(self, block: Block, owner: str) -> None:
        """Record that ``owner`` produced ``block``."""
        block.owners.add(owner)
        if block.resident:
            self._by_owner.setdefault(owner, set()).add(block)

    def discard_owner(self, block: Block, owner: str) -> None:
        """Forget ``owner`` on one block (erasure of a session that shares it)."""
        block.owners.discard(owner)
        owned = self._by_owner.get(owner)
        if owned is not None:
            owned.discard(block)
            if not owned:
                del self._by_owner[owner]

    def remove_owner(self, owner: str) -> list[Block]:
        """Forget ``owner`` everywhere.

        Returns:
            Resident blocks that no longer have any owner, in LRU order of access.
        """
        owned = self._by_owner.pop(owner, set())
        orphaned = []
        for block in owned:
            block.owners.discard(owner)
            if not block.owners:
                orphaned.append(block)
        orphaned.sort(key=lambda block: block.last_access)
        return orphaned

    def touch(self, block: Block) -> None:
        """Mark a use of ``block``: newest access stamp, end of the free queue."""
        block.last_access = self._clock()
        if block.prev_free is not None:
            self._queue(block).move_to_end(block)

    def acquire(self, block: Block) -> None:
        """Pin a resident block so it cannot be evicted."""
        if not block.resident:
            raise ValueError(f"cannot acquire non-resident block {block.block_hash.hex()}")
        if block.ref_count == 0:
            self._queue(block).remove(block)
        block.ref_count += 1

    def release(self, block: Block) -> bool:
        """Unpin a block; the last release of a resident block queues it as newest.

        Returns:
            True when this was the last reference.
        """
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_hash.hex()} released more often than acquired")
        block.ref_count -= 1
        if block.ref_count:
            return False
        if block.resident:
            block.last_access = self._clock()
            self._queue(block).append(block)
        return True

    def oldest_free(self) -> Block | None:
        """The least recently used unreferenced block, or None."""
        best: Block | None = None
        for queue in self._free.values():
            first = queue.first()
            if first is not None and (best is None or first.last_access < best.last_access):
                best = first
        return best

    def oldest_free_of(self, namespace: str | None) -> Block | None:
        """The least recently used unreferenced block of one namespace, or None."""
        queue = self._free.get(namespace)
        return queue.first() if queue is not None else None

    def _queue(self, block: Block) -> FreeQueue:
        queue = self._free.get(block.namespace)
        if queue is None:
            queue = self._free[block.namespace] = FreeQueue()
        return queue
