"""LRU eviction under a byte budget, pins, spilling, detached children."""

from __future__ import annotations

import random

from kv_cache.hashing import chain_hashes
from tests.kv_cache.factories import ROOT, Blob, make_cache, store, toks


def labels(blocks) -> list[str]:
    return [block.payload.label for block in blocks]


def test_exact_eviction_order_under_a_budget() -> None:
    spilled = []
    cache = make_cache(budget=50, spilled=spilled)
    store(cache, toks("A B C D E F G H I J K L"), label="x")  # x0 x1 x2, deepest oldest
    store(cache, toks("M N O P"), label="y")
    assert labels(cache.pool.free_blocks()) == ["x2", "x1", "x0", "y0"]
    store(cache, toks("Q R S T"), label="z")  # 50 bytes: fits
    assert spilled == []
    store(cache, toks("U V W X"), label="w")
    assert labels(spilled) == ["x2"]
    store(cache, toks("U V W X Y Z A B"), label="v")
    assert labels(spilled) == ["x2", "x1"]
    assert labels(cache.pool.free_blocks()) == ["x0", "y0", "z0", "v1", "w0"]
    assert cache.ram.used_bytes == 50
    assert (cache.stats.evictions, cache.stats.evicted_bytes) == (2, 20)
    assert (cache.ram.stats.evictions, cache.ram.stats.evicted_bytes) == (2, 20)


def test_touch_refreshes_a_chain() -> None:
    spilled = []
    cache = make_cache(budget=30, spilled=spilled)
    store(cache, toks("A B C D E F G H"), label="x")
    store(cache, toks("M N O P"), label="y")
    hit = cache.lookup(ROOT, toks("A B C D E F X"))
    cache.touch(hit.blocks)
    assert labels(cache.pool.free_blocks()) == ["x1", "y0", "x0"]
    store(cache, toks("Q R S T E F G H"), label="z")
    assert labels(spilled) == ["x1", "y0"]


def test_referenced_blocks_survive() -> None:
    spilled = []
    cache = make_cache(budget=40, spilled=spilled)
    pinned = store(cache, toks("A B C D E F G H"), label="x")
    cache.acquire(pinned)
    for index in range(5):
        store(cache, [100 + index] * 4, label=f"y{index}-")
    assert all(block.resident for block in pinned)
    assert labels(spilled) == ["y0-0", "y1-0", "y2-0"]
    cache.release(pinned)
    assert labels(cache.pool.free_blocks()) == ["y3-0", "y4-0", "x1", "x0"]


def test_refused_block_is_spilled_when_everything_is_pinned() -> None:
    spilled = []
    cache = make_cache(budget=20, spilled=spilled)
    pinned = store(cache, toks("A B C D E F G H"))
    cache.acquire(pinned)
    assert cache.insert_block(ROOT, toks("X Y Z W"), (), Blob(10, "refused"), partial=False) is None
    assert labels(spilled) == ["refused"]
    assert not spilled[0].resident
    assert cache.stats.rejected == 1
    assert cache.ram.stats.failed_reserves == 1
    assert cache.ram.used_bytes == 20


def test_block_larger_than_the_budget_evicts_nothing() -> None:
    spilled = []
    cache = make_cache(budget=20, spilled=spilled)
    store(cache, toks("A B C D"), label="x")
    assert cache.insert_block(ROOT, toks("X Y Z W"), (), Blob(21, "huge"), partial=False) is None
    assert labels(spilled) == ["huge"]
    assert len(cache) == 1


def test_spill_receives_every_evicted_block_exactly_once() -> None:
    spilled = []
    cache = make_cache(block_size=4, budget=300, spilled=spilled)
    rng = random.Random(7)
    admitted = {}
    pinned = []
    for step in range(400):
        length = rng.randrange(4, 40, 4)
        tokens = [rng.randrange(3) for _ in range(length)]  # few symbols: heavy sharing
        hit = cache.lookup(ROOT, tokens)
        cache.acquire(hit.blocks)
        pinned.append(hit.blocks)
        for block in store(cache, tokens, nbytes=rng.randrange(5, 30), partial=False):
            admitted[id(block)] = block
        if len(pinned) > 3:
            cache.release(pinned.pop(0))
        assert cache.ram.used_bytes <= 300
    spilled_ids = [id(block) for block in spilled]
    assert len(spilled_ids) == len(set(spilled_ids))
    assert len(spilled) == cache.stats.evictions + cache.stats.rejected
    assert all(not block.resident for block in spilled)
    resident = {id(block) for block in cache.pool}
    evicted = {id(block) for block in spilled} & admitted.keys()
    assert resident | evicted == admitted.keys()
    assert not resident & evicted
    assert cache.stats.evictions > 100


def test_children_of_an_evicted_parent_stay_and_are_readopted() -> None:
    spilled = []
    cache = make_cache(budget=30, spilled=spilled)
    first, second = store(cache, toks("A B C D E F G H"), label="x")
    cache.acquire([second])
    store(cache, toks("M N O P"), label="y")
    store(cache, toks("Q R S T"), label="z")
    assert labels(spilled) == ["x0"]
    assert second.resident
    assert dict(cache.pool.children_of(first.block_hash)) == {second.block_hash: second}
    assert cache.lookup(ROOT, toks("A B C D E F G H I")).hit_tokens == 0
    cache.release([second])
    # A lower tier hands the parent back: the child is attached again and the chain hits.
    returned = cache.insert_block(ROOT, toks("A B C D"), (), spilled[0].payload, partial=False)
    assert returned.children == {second.block_hash: second}
    hit = cache.lookup(ROOT, toks("A B C D E F G H I"))
    assert hit.blocks == (returned, second)
    assert hit.hit_tokens == 8


def test_shrinking_the_budget_evicts() -> None:
    spilled = []
    cache = make_cache(budget=100, spilled=spilled)
    store(cache, toks("A B C D E F G H I J K L"), label="x")
    assert cache.ram.set_budget(15)
    assert labels(spilled) == ["x2", "x1"]
    assert cache.ram.used_bytes == 10


def test_caches_sharing_a_budget_evict_globally_lru() -> None:
    spilled = []
    first = make_cache(budget=30, spilled=spilled)
    second = make_cache(ram=first.ram, spilled=spilled)
    store(first, toks("A B C D"), label="a")
    store(second, toks("A B C D"), label="b")
    store(first, toks("E F G H"), label="c")
    store(second, toks("I J K L"), label="d")
    assert labels(spilled) == ["a0"]
    assert (len(first), len(second)) == (1, 2)
    assert first.ram.used_bytes == 30


def test_evicted_chain_prefix_stops_lookup() -> None:
    spilled = []
    cache = make_cache(budget=1000, spilled=spilled)
    blocks = store(cache, toks("A B C D E F G H I J K L"))
    tokens = toks("A B C D E F G H I J K L")
    assert [block.block_hash for block in blocks] == chain_hashes(ROOT, tokens, [], 4)
    cache.acquire(blocks[1:])
    cache.ram.set_budget(20)
    assert spilled == [blocks[0]]
    assert cache.lookup(ROOT, toks("A B C D E F G H I J K L M")).hit_tokens == 0


def test_chain_harvested_block_by_block_ages_deepest_first() -> None:
    spilled = []
    cache = make_cache(budget=40, spilled=spilled)
    store(cache, toks("M N O P"), label="y")
    parent = ROOT
    for index, text in enumerate(("A B C D", "E F G H", "I J K L")):
        block = cache.insert_block(parent, toks(text), (), Blob(10, f"x{index}"), partial=False)
        parent = block.block_hash
    assert labels(cache.pool.free_blocks()) == ["y0", "x2", "x1", "x0"]
    store(cache, toks("Q R S T E F"), partial=False, label="z")
    store(cache, toks("U V W X"), label="w")
    assert labels(spilled) == ["y0", "x2"]
