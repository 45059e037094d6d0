"""Intrusive doubly linked queue of evictable blocks, least recently used first."""

from __future__ import annotations

from collections.abc import Iterator

from kv_cache.block import Block
from kv_cache.hashing import BlockHash


def _sentinel(name: bytes) -> Block:
    return Block(BlockHash(name), BlockHash(b""), (), (), None, 0, False)


class FreeQueue:
    """Unreferenced blocks in LRU order with O(1) append, popleft and remove.

    The links live in the blocks themselves (``prev_free``/``next_free``), and fake head and
    tail blocks remove every empty-list special case. A block is queued exactly when its
    ``prev_free`` is set.
    """

    __slots__ = ("_head", "_tail", "_length")

    def __init__(self) -> None:
        self._head = _sentinel(b"<head>")
        self._tail = _sentinel(b"<tail>")
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __contains__(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self) -> Iterator[Block]:
        """Blocks from least to most recently used."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: Block) -> None:
        """Add ``block`` as the most recently used."""
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_hash.hex()} is already queued")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._length += 1

    def insert_before(self, anchor: Block, block: Block) -> None:
        """Add ``block`` just before the queued ``anchor`` (one step less recently used)."""
        before = anchor.prev_free
        if before is None:
            raise ValueError(f"anchor block {anchor.block_hash.hex()} is not queued")
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_hash.hex()} is already queued")
        before.next_free = block
        block.prev_free = before
        block.next_free = anchor
        anchor.prev_free = block
        self._length += 1

    def first(self) -> Block | None:
        """The least recently used block, or None when empty."""
        node = self._head.next_free
        return None if node is self._tail else node

    def popleft(self) -> Block | None:
        """Remove and return the least recently used block, or None when empty."""
        node = self.first()
        if node is not None:
            self.remove(node)
        return node

    def remove(self, block: Block) -> None:
        """Unlink ``block`` (which must be queued)."""
        before, after = block.prev_free, block.next_free
        if before is None or after is None:
            raise ValueError(f"block {block.block_hash.hex()} is not queued")
        before.next_free = after
        after.prev_free = before
        block.prev_free = None
        block.next_free = None
        self._length -= 1

    def move_to_end(self, block: Block) -> None:
        """Make a queued block the most recently used."""
        self.remove(block)
        self.append(block)
