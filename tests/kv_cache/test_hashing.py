"""Chained block hashes: golden values, encoding, tenant and image separation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash

from kv_cache.hashing import (
    CACHE_FORMAT_VERSION,
    BlockHash,
    ImageSpan,
    block_extra_keys,
    chain_hashes,
    extra_keys_by_block,
    hash_block,
    root_hash,
)
from vision_cache.hashing import ImageHash

IMG_A = ImageHash(b"\xaa" * 16)
IMG_B = ImageHash(b"\xbb" * 16)


def make_root(salt: bytes = b"salt-1", fingerprint: str = "model-a") -> BlockHash:
    return root_hash(CACHE_FORMAT_VERSION, fingerprint, salt)


def test_format_version_is_one() -> None:
    assert CACHE_FORMAT_VERSION == 1


def test_golden_root_hash() -> None:
    assert make_root().hex() == "c3bd492de65500046ba7b9dbc4875191"


def test_golden_block_hashes() -> None:
    root = make_root()
    assert hash_block(root, [1, 2, 3, 4], ()).hex() == "38a3cc6cc57f9c4c36c9011cf888b9a6"
    assert hash_block(root, [1, 2, 3, 4], ((IMG_A, 2),)).hex() == "2c110a359ca7426c7d80f65ecd45af88"
    assert (
        hash_block(root, [1, 2, 3, 4], ((IMG_A, -3),)).hex() == "2d1f2da7d0df6312c8b2e16d25a9bc8f"
    )


def test_golden_chain() -> None:
    hashes = chain_hashes(make_root(), list(range(10)), [ImageSpan(IMG_A, 5, 7)], 4)
    assert [h.hex() for h in hashes] == [
        "1024cdff0816e3d1c830c5a49117a934",
        "a3e64b9b8457933622eaaf2427b2f5db",
    ]


def test_encoding_matches_the_documented_layout() -> None:
    root = make_root()
    fingerprint, salt = b"model-a", b"salt-1"
    expected_root = xxhash.xxh3_128_digest(
        b"vlmcache.kv.root\x00"
        + struct.pack("<II", 1, len(fingerprint))
        + fingerprint
        + struct.pack("<I", len(salt))
        + salt
    )
    assert root == expected_root
    expected_block = xxhash.xxh3_128_digest(
        root
        + struct.pack("<I", 4)
        + struct.pack("<4i", 1, 2, 3, -5)
        + struct.pack("<I", 1)
        + struct.pack("<I", 16)
        + IMG_A
        + struct.pack("<q", -3)
    )
    assert hash_block(root, [1, 2, 3, -5], ((IMG_A, -3),)) == expected_block


def test_token_container_does_not_matter() -> None:
    root = make_root()
    tokens = [7, 8, 9, 150000]
    expected = hash_block(root, tokens, ())
    assert hash_block(root, tuple(tokens), ()) == expected
    assert hash_block(root, np.array(tokens, dtype=np.int64), ()) == expected
    assert hash_block(root, np.array(tokens, dtype=np.uint32), ()) == expected


def test_token_out_of_int32_range_is_rejected() -> None:
    with pytest.raises(ValueError, match="int32"):
        hash_block(make_root(), [1, 2**31], ())
    with pytest.raises(ValueError, match="int32"):
        hash_block(make_root(), np.array([1, 2**31]), ())


def test_bad_digest_is_rejected() -> None:
    with pytest.raises(ValueError, match="16-byte"):
        hash_block(BlockHash(b"short"), [1], ())


def test_root_depends_on_every_input() -> None:
    base = make_root()
    assert root_hash(2, "model-a", b"salt-1") != base
    assert make_root(fingerprint="model-b") != base
    assert make_root(salt=b"salt-2") != base
    # Lengths are encoded: moving bytes between fingerprint and salt changes the root.
    assert root_hash(1, "ab", b"c") != root_hash(1, "a", b"bc")


def test_extra_keys_and_token_count_are_unambiguous() -> None:
    root = make_root()
    assert hash_block(root, [1, 2], ()) != hash_block(root, [1, 2, 0], ())
    assert hash_block(root, [1, 2], ((IMG_A, 0),)) != hash_block(root, [1, 2], ())
    assert hash_block(root, [1, 2], ((IMG_A, 0),)) != hash_block(root, [1, 2], ((IMG_A, 1),))
    assert hash_block(root, [1, 2], ((IMG_A, 0), (IMG_B, 1))) != hash_block(
        root, [1, 2], ((IMG_B, 1), (IMG_A, 0))
    )


def test_block_extra_keys() -> None:
    spans = [ImageSpan(IMG_A, 2, 9), ImageSpan(IMG_B, 9, 10)]
    assert block_extra_keys(0, 4, spans) == ((IMG_A, 2),)
    assert block_extra_keys(4, 4, spans) == ((IMG_A, -2),)
    assert block_extra_keys(8, 4, spans) == ((IMG_A, -6), (IMG_B, 1))
    assert block_extra_keys(12, 4, spans) == ()
    # A partial block uses its own end: [8, 9) overlaps only the first image.
    assert block_extra_keys(8, 1, spans) == ((IMG_A, -6),)


def test_extra_keys_by_block_equals_per_block_keys() -> None:
    spans = [ImageSpan(IMG_A, 3, 21), ImageSpan(IMG_B, 21, 22), ImageSpan(IMG_A, 40, 41)]
    index = extra_keys_by_block(spans, 8)
    for block in range(8):
        assert index.get(block, ()) == block_extra_keys(block * 8, 8, spans)


def test_image_span_validation() -> None:
    with pytest.raises(ValueError, match="start < end"):
        ImageSpan(IMG_A, 4, 4)
    with pytest.raises(ValueError, match="start < end"):
        ImageSpan(IMG_A, -1, 4)


def test_chain_only_covers_full_blocks() -> None:
    assert len(chain_hashes(make_root(), list(range(11)), [], 4)) == 2
    assert chain_hashes(make_root(), [], [], 4) == []


def test_different_tenant_salt_gives_disjoint_chains() -> None:
    tokens = list(range(64))
    chain_a = chain_hashes(make_root(salt=b"tenant-a"), tokens, [], 8)
    chain_b = chain_hashes(make_root(salt=b"tenant-b"), tokens, [], 8)
    assert len(chain_a) == len(chain_b) == 8
    assert set(chain_a).isdisjoint(chain_b)


def test_same_text_different_image_shares_blocks_before_the_image() -> None:
    tokens = list(range(100, 140))  # 10 blocks of 4; image placeholders at [13, 20)
    chain_a = chain_hashes(make_root(), tokens, [ImageSpan(IMG_A, 13, 20)], 4)
    chain_b = chain_hashes(make_root(), tokens, [ImageSpan(IMG_B, 13, 20)], 4)
    # Block 3 = [12, 16) is the image's first block.
    assert chain_a[:3] == chain_b[:3]
    assert all(a != b for a, b in zip(chain_a[3:], chain_b[3:], strict=True))
    assert chain_a[:3] == chain_hashes(make_root(), tokens[:12], [], 4)


def test_same_image_at_other_offset_differs_from_its_block_on() -> None:
    tokens = list(range(100, 140))
    chain_at_13 = chain_hashes(make_root(), tokens, [ImageSpan(IMG_A, 13, 20)], 4)
    chain_at_14 = chain_hashes(make_root(), tokens, [ImageSpan(IMG_A, 14, 21)], 4)
    assert chain_at_13[:3] == chain_at_14[:3]
    assert all(a != b for a, b in zip(chain_at_13[3:], chain_at_14[3:], strict=True))
