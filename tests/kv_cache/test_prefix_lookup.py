"""Lookup: chain walk, token-granular tail, the never-whole-prompt cap, verification."""

from __future__ import annotations

import numpy as np

from kv_cache.block import Block
from kv_cache.hashing import ImageSpan, block_extra_keys, hash_block
from tests.kv_cache.factories import ROOT, Blob, make_cache, store, toks
from vision_cache.hashing import ImageHash

IMG_A = ImageHash(b"\xaa" * 16)
IMG_B = ImageHash(b"\xbb" * 16)


def tail(hit) -> list[tuple[tuple[int, ...], int]]:
    return [(block.tokens, matched) for block, matched in hit.tail_candidates]


def test_tail_inside_a_full_block() -> None:
    cache = make_cache()
    first, second = store(cache, toks("A B C D E F G H"))
    hit = cache.lookup(ROOT, toks("A B C D E F X"))
    assert hit.blocks == (first,)
    assert hit.tail_candidates == ((second, 2),)
    assert hit.hit_tokens == 6


def test_tail_from_a_partial_block() -> None:
    cache = make_cache()
    first, partial = store(cache, toks("A B C D E F"))
    assert partial.is_partial and partial.tokens == tuple(toks("E F"))
    hit = cache.lookup(ROOT, toks("A B C D E F G H I"))
    assert hit.blocks == (first,)
    assert hit.tail_candidates == ((partial, 2),)
    assert hit.hit_tokens == 6


def test_exact_match_leaves_the_last_token() -> None:
    cache = make_cache()
    first, second = store(cache, toks("A B C D E F G H"))
    hit = cache.lookup(ROOT, toks("A B C D E F G H"))
    # The final full block is not walked (it would cover the whole prompt): it is the tail.
    assert hit.blocks == (first,)
    assert hit.tail_candidates == ((second, 3),)
    assert hit.hit_tokens == 7


def test_exact_match_of_a_single_block_prompt() -> None:
    cache = make_cache()
    (first,) = store(cache, toks("A B C D"))
    hit = cache.lookup(ROOT, toks("A B C D"))
    assert hit.blocks == ()
    assert hit.tail_candidates == ((first, 3),)
    assert hit.hit_tokens == 3


def test_cached_longer_than_asked() -> None:
    cache = make_cache()
    first, second, _ = store(cache, toks("A B C D E F G H I J"))
    assert cache.lookup(ROOT, toks("A B C D E")).hit_tokens == 4
    hit = cache.lookup(ROOT, toks("A B C D E F"))
    assert hit.blocks == (first,)
    assert hit.tail_candidates == ((second, 1),)
    assert hit.hit_tokens == 5


def test_prompt_extends_the_cached_sequence() -> None:
    cache = make_cache()
    blocks = store(cache, toks("A B C D E F G H"))
    hit = cache.lookup(ROOT, toks("A B C D E F G H I J K L M"))
    assert hit.blocks == tuple(blocks)
    assert hit.tail_candidates == ()
    assert hit.hit_tokens == 8


def test_miss_and_tiny_prompts() -> None:
    cache = make_cache()
    store(cache, toks("A B C D E F G H"))
    assert cache.lookup(ROOT, toks("X B C D E F")).hit_tokens == 0
    assert cache.lookup(ROOT, toks("A")) == cache.lookup(ROOT, [])
    assert cache.lookup(ROOT, toks("A")).hit_tokens == 0
    hit = cache.lookup(ROOT, toks("A B"))
    assert tail(hit) == [(tuple(toks("A B C D")), 1)]


def test_candidates_sorted_by_matched_tokens() -> None:
    cache = make_cache()
    store(cache, toks("A B C D E F G H"))
    store(cache, toks("A B C D E F X"))
    store(cache, toks("A B C D E Y"))
    hit = cache.lookup(ROOT, toks("A B C D E F X Y Z"))
    assert tail(hit) == [
        (tuple(toks("E F X")), 3),
        (tuple(toks("E F G H")), 2),
        (tuple(toks("E Y")), 1),
    ]
    assert hit.hit_tokens == 7
    assert hit.tail_tokens == 3


def test_lookup_accepts_numpy_tokens() -> None:
    cache = make_cache()
    store(cache, toks("A B C D E F G H"))
    assert cache.lookup(ROOT, np.array(toks("A B C D E F X"), dtype=np.int64)).hit_tokens == 6


def test_other_root_does_not_match() -> None:
    cache = make_cache()
    store(cache, toks("A B C D E F G H"))
    other = hash_block(ROOT, [0], ())
    assert cache.lookup(other, toks("A B C D E F G H I")).hit_tokens == 0


def test_lookup_changes_neither_lru_order_nor_refs() -> None:
    cache = make_cache()
    first = store(cache, toks("A B C D E F G H"))
    second = store(cache, toks("X B C D"))
    order = list(cache.pool.free_blocks())
    stamps = [block.last_access for block in order]
    cache.lookup(ROOT, toks("A B C D E F G H I"))
    assert list(cache.pool.free_blocks()) == order == [first[1], first[0], second[0]]
    assert [block.last_access for block in order] == stamps
    assert all(block.ref_count == 0 for block in order)


def test_different_image_matches_only_up_to_the_image() -> None:
    cache = make_cache()
    tokens = toks("A B C D E F G H I J")
    first, second, _ = store(cache, tokens, spans=[ImageSpan(IMG_A, 6, 8)])
    hit = cache.lookup(ROOT, tokens, [ImageSpan(IMG_B, 6, 8)])
    # Block 1 = [4, 8) holds the image at offset 2: its first two tokens are still valid.
    assert hit.blocks == (first,)
    assert hit.tail_candidates == ((second, 2),)
    assert hit.hit_tokens == 6


def test_same_image_matches_through_it() -> None:
    cache = make_cache()
    tokens = toks("A B C D E F G H I J")
    blocks = store(cache, tokens, spans=[ImageSpan(IMG_A, 3, 8)])
    hit = cache.lookup(ROOT, tokens + toks("K"), [ImageSpan(IMG_A, 3, 8)])
    assert hit.blocks == tuple(blocks[:2])
    assert hit.tail_candidates == ((blocks[2], 2),)
    assert hit.hit_tokens == 10


def test_image_spanning_into_the_tail_block_must_agree() -> None:
    cache = make_cache()
    tokens = toks("A B C D E F G H I J")
    blocks = store(cache, tokens, spans=[ImageSpan(IMG_A, 2, 6)])
    # Same text, the cached image missing from the request: only tokens before it match.
    assert cache.lookup(ROOT, tokens).hit_tokens == 2
    # Another image there: block 0 misses, its first two tokens still match.
    hit = cache.lookup(ROOT, tokens, [ImageSpan(IMG_B, 2, 6)])
    assert hit.blocks == ()
    assert hit.tail_candidates == ((blocks[0], 2),)
    # The same image continuing into the tail block (offset -2) agrees there.
    hit = cache.lookup(ROOT, toks("A B C D E F X"), [ImageSpan(IMG_A, 2, 6)])
    assert hit.blocks == (blocks[0],)
    assert hit.tail_candidates == ((blocks[1], 2),)
    assert blocks[1].extra == block_extra_keys(4, 4, [ImageSpan(IMG_A, 2, 6)]) == ((IMG_A, -2),)


def test_forged_collision_is_not_served() -> None:
    cache = make_cache()
    wanted = toks("A B C D")
    # A block whose hash is that of "A B C D" but whose stored tokens are different.
    forged_hash = hash_block(ROOT, wanted, ())
    forged = Block(forged_hash, ROOT, tuple(toks("W X Y Z")), (), Blob(10), 10, False)
    cache.pool.add(forged)
    hit = cache.lookup(ROOT, wanted + toks("E"))
    assert hit.blocks == ()
    assert hit.hit_tokens == 0
    # The genuine block cannot be stored under the taken hash either.
    assert cache.insert_block(ROOT, wanted, (), Blob(10), partial=False) is None
    assert cache.stats.collisions == 1


def test_forged_collision_sharing_a_prefix_serves_only_its_real_tokens() -> None:
    cache = make_cache()
    wanted = toks("A B C D")
    forged_hash = hash_block(ROOT, wanted, ())
    forged = Block(forged_hash, ROOT, tuple(toks("A B Y Z")), (), Blob(10), 10, False)
    cache.pool.add(forged)
    hit = cache.lookup(ROOT, wanted + toks("E"))
    assert hit.blocks == ()
    assert hit.tail_candidates == ((forged, 2),)


def test_forged_extra_keys_are_not_served() -> None:
    cache = make_cache()
    tokens = toks("A B C D")
    keys = ((IMG_A, 0),)
    # Hash of the tokens with image A at offset 0, stored with no image key.
    forged = Block(hash_block(ROOT, tokens, keys), ROOT, tuple(tokens), (), Blob(10), 10, False)
    cache.pool.add(forged)
    hit = cache.lookup(ROOT, tokens + toks("E"), [ImageSpan(IMG_A, 0, 4)])
    assert hit.blocks == ()
    assert hit.hit_tokens == 0


def test_stats_count_lookups_and_hits() -> None:
    cache = make_cache()
    store(cache, toks("A B C D E F G H"))
    cache.lookup(ROOT, toks("A B C D E F X"))
    cache.lookup(ROOT, toks("Q"))
    assert (cache.stats.lookups, cache.stats.hit_blocks, cache.stats.hit_tokens) == (2, 1, 6)
