"""Free queue, block pool, RAM tier and sizing in isolation."""

from __future__ import annotations

from collections import namedtuple

import mlx.core as mx
import numpy as np
import pytest

from kv_cache.block import Block
from kv_cache.block_pool import BlockPool
from kv_cache.free_queue import FreeQueue
from kv_cache.hashing import BlockHash
from kv_cache.sizing import array_nbytes, tree_nbytes
from kv_cache.tiers import ram as ram_module
from kv_cache.tiers.ram import MIN_RAM_BUDGET, RamTier, default_ram_budget
from tests.kv_cache.factories import Blob


def make_block(name: str, parent: str = "root", *, nbytes: int = 1) -> Block:
    return Block(
        BlockHash(name.encode().ljust(16, b".")),
        BlockHash(parent.encode().ljust(16, b".")),
        (1,),
        (),
        Blob(nbytes, name),
        nbytes,
        False,
    )


def names(blocks) -> list[str]:
    return [block.payload.label for block in blocks]


def test_free_queue_order_and_o1_operations() -> None:
    queue = FreeQueue()
    a, b, c, d = (make_block(name) for name in "abcd")
    for block in (a, b, c, d):
        queue.append(block)
    queue.remove(c)
    queue.move_to_end(a)
    assert names(queue) == ["b", "d", "a"]
    assert len(queue) == 3
    assert queue.popleft() is b
    assert queue.first() is d
    assert c not in queue and d in queue
    with pytest.raises(ValueError, match="already queued"):
        queue.append(d)
    with pytest.raises(ValueError, match="not queued"):
        queue.remove(c)
    assert queue.popleft() is d and queue.popleft() is a
    assert queue.popleft() is None and len(queue) == 0


def test_pool_refcounts_gate_the_free_queue() -> None:
    pool = BlockPool()
    a, b = make_block("a"), make_block("b", "a")
    pool.add(a)
    pool.add(b)
    pool.acquire(a)
    pool.acquire(a)
    assert names(pool.free_blocks()) == ["b"]
    assert pool.release(a) is False
    assert pool.release(a) is True
    assert names(pool.free_blocks()) == ["b", "a"]
    with pytest.raises(ValueError, match="released more often than acquired"):
        pool.release(a)
    with pytest.raises(ValueError, match="already resident"):
        pool.add(make_block("a"))


def test_pool_detaches_and_readopts_children() -> None:
    pool = BlockPool()
    parent, child = make_block("p"), make_block("c", "p")
    pool.add(child)  # parent not resident yet: detached
    assert dict(pool.children_of(parent.block_hash)) == {child.block_hash: child}
    pool.add(parent)
    assert parent.children == {child.block_hash: child}
    assert dict(pool.children_of(BlockHash(b"root".ljust(16, b".")))) == {parent.block_hash: parent}
    pool.remove(parent)
    assert parent.children == {}
    assert dict(pool.children_of(parent.block_hash)) == {child.block_hash: child}
    pool.remove(child)
    assert dict(pool.children_of(parent.block_hash)) == {}
    assert len(pool) == 0


def test_pool_owner_index() -> None:
    pool = BlockPool()
    a, b = make_block("a"), make_block("b")
    pool.add(a)
    pool.add(b)
    pool.add_owner(a, "s1")
    pool.add_owner(b, "s1")
    pool.add_owner(b, "s2")
    assert pool.owned_by("s1") == {a, b}
    assert pool.remove_owner("s1") == [a]
    assert pool.owned_by("s1") == frozenset()
    pool.remove(b)
    assert pool.owned_by("s2") == frozenset()


def test_default_ram_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    memory = namedtuple("memory", "available")
    monkeypatch.setattr(ram_module.psutil, "virtual_memory", lambda: memory(10_000_000_000))
    assert default_ram_budget() == 2_000_000_000
    assert RamTier().budget_bytes == 2_000_000_000
    monkeypatch.setattr(ram_module.psutil, "virtual_memory", lambda: memory(100_000_000))
    assert default_ram_budget() == MIN_RAM_BUDGET == 104_857_600


def test_ram_tier_accounting() -> None:
    ram = RamTier(100)
    assert ram.reserve(100) and not ram.reserve(101)
    ram.charge(60)
    assert (ram.used_bytes, ram.free_bytes) == (60, 40)
    assert not ram.reserve(41)  # nothing registered to evict
    ram.discharge(60)
    with pytest.raises(ValueError, match="cannot discharge 1 bytes with 0 charged"):
        ram.discharge(1)
    with pytest.raises(ValueError, match=">= 0"):
        RamTier(-1)
    assert ram.tick() < ram.tick()


def test_array_nbytes_from_shape_and_dtype() -> None:
    assert array_nbytes(np.zeros((3, 5), dtype=np.float32)) == 60
    lazy = mx.zeros((2, 4, 8), dtype=mx.float16) * 3 + 1
    assert array_nbytes(lazy) == 128
    assert array_nbytes(mx.zeros((7,), dtype=mx.bfloat16)) == 14
    with pytest.raises(TypeError, match="got int"):
        array_nbytes(3)


def test_tree_nbytes() -> None:
    keys = mx.zeros((1, 2, 64, 8), dtype=mx.float16)
    tree = {"layers": [(keys, keys), (keys, None)], "state": (np.zeros(10, dtype=np.int64),)}
    assert tree_nbytes(tree) == 3 * 2048 + 80
    assert tree_nbytes(None) == 0


def test_free_queue_insert_before() -> None:
    queue = FreeQueue()
    a, b, c = (make_block(name) for name in "abc")
    queue.append(a)
    queue.insert_before(a, b)
    queue.insert_before(a, c)
    assert names(queue) == ["b", "c", "a"]
    with pytest.raises(ValueError, match="not queued"):
        queue.insert_before(make_block("d"), make_block("e"))


def test_pool_queues_a_child_just_before_its_unreferenced_parent() -> None:
    pool = BlockPool()
    other, parent, child = make_block("o"), make_block("p"), make_block("c", "p")
    pool.add(parent)
    pool.add(other)
    pool.add(child)
    assert names(pool.free_blocks()) == ["c", "p", "o"]
    assert child.last_access == parent.last_access < other.last_access
