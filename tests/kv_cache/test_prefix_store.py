"""Storing: sharing, partial blocks, superseding, owners, insert_block."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kv_cache.hashing import ImageSpan, block_extra_keys, chain_hashes, hash_block
from tests.kv_cache.factories import ROOT, Blob, make_cache, store, toks
from vision_cache.hashing import ImageHash

IMG_A = ImageHash(b"\xaa" * 16)
IMG_B = ImageHash(b"\xbb" * 16)


def test_store_keys_blocks_by_chain_hash() -> None:
    cache = make_cache()
    tokens = toks("A B C D E F G H I J")
    blocks = store(cache, tokens, spans=[ImageSpan(IMG_A, 5, 6)], label="x")
    full_hashes = chain_hashes(ROOT, tokens, [ImageSpan(IMG_A, 5, 6)], 4)
    partial_hash = hash_block(full_hashes[-1], toks("I J"), ())
    assert [block.block_hash for block in blocks] == [*full_hashes, partial_hash]
    assert [block.payload.label for block in blocks] == ["x0", "x1", "xp"]
    assert [block.is_partial for block in blocks] == [False, False, True]
    assert blocks[1].extra == ((IMG_A, 1),)
    assert blocks[0].children == {blocks[1].block_hash: blocks[1]}
    assert blocks[1].children == {blocks[2].block_hash: blocks[2]}
    assert dict(cache.pool.children_of(ROOT)) == {blocks[0].block_hash: blocks[0]}
    assert cache.resident_bytes == cache.ram.used_bytes == 30


def test_longer_sequence_shares_common_blocks() -> None:
    cache = make_cache()
    short = store(cache, toks("A B C D E F G H"), owner="s1")
    long = store(cache, toks("A B C D E F G H I J K L"), owner="s2")
    assert long[:2] == short
    assert len(cache) == 3
    assert (cache.stats.inserts, cache.stats.already_present) == (3, 2)
    assert short[0].owners == {"s1", "s2"}
    assert long[2].owners == {"s2"}
    assert cache.ram.used_bytes == 30


def test_hundred_sessions_share_a_system_prompt_once() -> None:
    cache = make_cache(block_size=64)
    system = list(range(1000, 2000))
    for session in range(100):
        user = [5000 + session * 100 + index for index in range(60)]
        store(cache, system + user, owner=f"session-{session}", nbytes=1)
    system_hashes = chain_hashes(ROOT, system, [], 64)
    assert len(system_hashes) == 15
    for block_hash in system_hashes:
        block = cache.pool.get(block_hash)
        assert block is not None
        assert len(block.owners) == 100
    # Each session adds its own block 15 ([960, 1024)) and a 36-token partial.
    assert len(cache) == 15 + 100 * 2
    assert cache.stats.inserts == 215
    hit = cache.lookup(ROOT, system + [9, 9, 9])
    assert hit.hit_tokens == 1000
    assert len(hit.blocks) == 15
    assert len(hit.tail_candidates) == 100
    assert {matched for _, matched in hit.tail_candidates} == {40}


def test_full_block_supersedes_a_stored_partial() -> None:
    spilled = []
    cache = make_cache(spilled=spilled)
    first, partial = store(cache, toks("A B C D E F"))
    assert cache.ram.used_bytes == 20
    blocks = store(cache, toks("A B C D E F G H"))
    assert blocks[0] is first
    assert not partial.resident
    assert cache.pool.get(partial.block_hash) is None
    assert list(first.children.values()) == [blocks[1]]
    assert cache.ram.used_bytes == cache.resident_bytes == 20
    assert cache.stats.superseded_partials == 1
    assert spilled == []


def test_longer_partial_supersedes_a_shorter_one() -> None:
    cache = make_cache()
    _, short = store(cache, toks("A B C D E"))
    _, longer = store(cache, toks("A B C D E F G"))
    assert not short.resident and longer.resident
    assert cache.ram.used_bytes == 20
    hit = cache.lookup(ROOT, toks("A B C D E F G H I"))
    assert hit.tail_candidates == ((longer, 3),)


def test_partial_with_other_image_is_not_superseded() -> None:
    cache = make_cache()
    _, partial = store(cache, toks("A B C D E F"), spans=[ImageSpan(IMG_A, 4, 6)])
    blocks = store(cache, toks("A B C D E F G H"), spans=[ImageSpan(IMG_B, 4, 6)])
    assert partial.resident
    assert set(blocks[0].children.values()) == {partial, blocks[1]}


def test_referenced_partial_is_freed_on_release() -> None:
    cache = make_cache()
    _, partial = store(cache, toks("A B C D E F"))
    cache.acquire([partial])
    store(cache, toks("A B C D E F G H"))
    assert not partial.resident
    assert cache.resident_bytes == 20
    assert cache.ram.used_bytes == 30
    cache.release([partial])
    assert cache.ram.used_bytes == 20


def test_covered_partial_stores_nothing() -> None:
    cache = make_cache()
    first, second = store(cache, toks("A B C D E F G H"), owner="s1")
    blocks = store(cache, toks("A B C D E F"), owner="s2")
    assert blocks == [first, second]
    assert len(cache) == 2
    assert cache.stats.covered_partials == 1
    # The covering block also holds tokens s2 never produced: s2 does not own it.
    assert second.owners == {"s1"}
    assert first.owners == {"s1", "s2"}


def test_insert_block_harvest_matches_store() -> None:
    cache = make_cache()
    tokens = toks("A B C D E F G H I J")
    spans = [ImageSpan(IMG_A, 3, 5)]
    hashes = chain_hashes(ROOT, tokens, spans, 4)
    parent = ROOT
    harvested = []
    for index in range(2):
        window = tokens[index * 4 : index * 4 + 4]
        block = cache.insert_block(
            parent, window, block_extra_keys(index * 4, 4, spans), Blob(10), "s1", partial=False
        )
        harvested.append(block)
        parent = block.block_hash
    tail = cache.insert_block(
        parent, tokens[8:], block_extra_keys(8, 2, spans), Blob(5), partial=True
    )
    assert [block.block_hash for block in harvested] == hashes
    assert tail.is_partial and tail.tokens == tuple(tokens[8:])
    again = store(cache, tokens, spans=spans, owner="s2")
    assert again == [*harvested, tail]
    assert len(cache) == 3


def test_insert_block_validates_sizes_and_payload() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="full block needs 4 tokens, got 3"):
        cache.insert_block(ROOT, toks("A B C"), (), Blob(1), partial=False)
    with pytest.raises(ValueError, match="partial block needs 1..3 tokens, got 4"):
        cache.insert_block(ROOT, toks("A B C D"), (), Blob(1), partial=True)
    with pytest.raises(ValueError, match="no payload"):
        cache.insert_block(ROOT, toks("A B C D"), (), None, partial=False)
    with pytest.raises(ValueError, match="2 full blocks, got 1 payloads"):
        cache.store(ROOT, toks("A B C D E F G H"), (), [Blob(1)])
    with pytest.raises(ValueError, match="no partial block"):
        cache.store(ROOT, toks("A B C D"), (), [Blob(1)], partial_payload=Blob(1))


def test_store_with_none_payload_for_present_blocks() -> None:
    cache = make_cache()
    first, _ = store(cache, toks("A B C D E F G H"))
    blocks = cache.store(ROOT, toks("A B C D X Y Z W"), (), [None, Blob(10)])
    assert blocks[0] is first
    assert len(cache) == 3


def test_remove_owner_returns_unowned_blocks() -> None:
    cache = make_cache()
    shared = store(cache, toks("A B C D E F G H"), owner="s1")
    own = store(cache, toks("A B C D E F G H I J K L"), owner="s2")
    assert cache.remove_owner("s2") == [own[2]]
    assert shared[0].owners == {"s1"}
    assert cache.remove_owner("s1") == [shared[1], shared[0]]
    assert cache.remove_owner("unknown") == []
    cache.discard(own[2])
    assert len(cache) == 2
    assert cache.stats.discarded == 1
    assert cache.ram.used_bytes == 20


@dataclass(frozen=True)
class Checkpointed:
    """A payload carrying recurrent state taken exactly at its block's end."""

    nbytes: int
    checkpointed: bool = True


def test_checkpointed_partial_is_neither_superseded_nor_covered() -> None:
    cache = make_cache()
    (first,) = store(cache, toks("A B C D"), partial=False)
    kept = cache.insert_block(
        first.block_hash, toks("E F"), (), Checkpointed(10), "s1", partial=True
    )
    assert kept is not None
    full = store(cache, toks("A B C D E F G H"), partial=False)
    assert kept.resident
    assert set(first.children.values()) == {kept, full[1]}
    # A new checkpointed partial under a covering full block is stored, not folded into it.
    shorter = cache.insert_block(
        first.block_hash, toks("E"), (), Checkpointed(10), "s1", partial=True
    )
    assert shorter is not None and shorter is not full[1] and shorter.resident
    assert cache.stats.superseded_partials == 0 and cache.stats.covered_partials == 0
    hit = cache.lookup(ROOT, toks("A B C D E F X"))
    assert [(b.tokens, m) for b, m in hit.tail_candidates] == [
        (tuple(toks("E F G H")), 2),
        (tuple(toks("E F")), 2),
        (tuple(toks("E")), 1),
    ]
