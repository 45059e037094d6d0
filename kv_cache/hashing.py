"""Chained block hashes with image keys folded in.

Block ``i`` of a prompt covers tokens ``[i*B, (i+1)*B)``. Its hash chains the parent's digest,
the block's token ids and the "extra keys" of the images whose placeholder spans overlap it::

    h_i = xxh3_128(h_{i-1} || u32 n || n * int32 LE token
                   || u32 k || k * (u32 len || image hash || i64 offset))
    h_-1 = root = xxh3_128(tag || u32 format version || u32 len || fingerprint || u32 len || salt)

Every variable-length part carries its length, so two different inputs can never encode to the
same byte string. Text before the first image carries no image key, so it is shared across
requests with different images; an image's blocks (and everything after) are keyed by the
image's hash *and* its offset, so a different image, or the same image elsewhere, never reuses
them.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import xxhash

from vision_cache.hashing import ImageHash

# xxh3_128 digest (16 bytes) of a block's parent digest, token ids and extra keys.
BlockHash = NewType("BlockHash", bytes)

# Bump whenever the hash encoding or the meaning of a stored block changes: it seeds every root,
# so old blocks (on SSD, in Redis) simply stop matching instead of being misread.
CACHE_FORMAT_VERSION: int = 1

DIGEST_SIZE = 16

# (image hash, span.start - block_start): negative when the image began in an earlier block.
ExtraKey = tuple[ImageHash, int]

_ROOT_TAG = b"vlmcache.kv.root\x00"
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_NO_EXTRA = _U32.pack(0)
_digest = xxhash.xxh3_128_digest


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """Token span ``[start, end)`` of one image's placeholder tokens in a prompt.

    Attributes:
        image_hash: Tenant-salted hash of the image pixels.
        start: Index of the first placeholder token.
        end: One past the last placeholder token.
    """

    image_hash: ImageHash
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"image span needs 0 <= start < end, got [{self.start}, {self.end})")
        if not isinstance(self.image_hash, bytes) or not self.image_hash:
            raise ValueError(f"image_hash must be non-empty bytes, got {self.image_hash!r}")


def root_hash(format_version: int, model_fingerprint: str, tenant_salt: bytes) -> BlockHash:
    """Hash that every chain of one (format, model, tenant) starts from.

    Args:
        format_version: Cache format version, normally ``CACHE_FORMAT_VERSION``.
        model_fingerprint: Identity of the model weights and config.
        tenant_salt: Per-tenant secret salt; different salts give disjoint chains.

    Returns:
        The 16-byte root digest (the parent of block 0).
    """
    if not 0 <= format_version < 2**32:
        raise ValueError(f"format_version must fit in u32, got {format_version}")
    fingerprint = model_fingerprint.encode("utf-8")
    salt = bytes(tenant_salt)
    data = b"".join(
        (
            _ROOT_TAG,
            _U32.pack(format_version),
            _U32.pack(len(fingerprint)),
            fingerprint,
            _U32.pack(len(salt)),
            salt,
        )
    )
    return BlockHash(_digest(data))


def hash_block(
    parent: BlockHash, tokens: Sequence[int] | np.ndarray, extra: tuple[ExtraKey, ...]
) -> BlockHash:
    """Hash of one block (full or partial) given its parent.

    Args:
        parent: Digest of the previous block, or the root for block 0.
        tokens: The block's token ids (each must fit in int32).
        extra: Extra keys of the block, as from ``block_extra_keys``.

    Returns:
        The block's 16-byte digest.
    """
    check_digest(parent, "parent")
    token_bytes = token_array(tokens).tobytes()
    return hash_block_bytes(parent, token_bytes, len(token_bytes) // 4, encode_extra(extra))


def block_extra_keys(
    block_start: int, block_size: int, spans: Sequence[ImageSpan]
) -> tuple[ExtraKey, ...]:
    """Extra keys of the block ``[block_start, block_start + block_size)``.

    Args:
        block_start: Index of the block's first token.
        block_size: Number of tokens in the block (a partial block passes its own length).
        spans: Image spans of the prompt.

    Returns:
        ``(image_hash, span.start - block_start)`` for each span overlapping the block, in span
        order.
    """
    if block_start < 0 or block_size <= 0:
        raise ValueError(f"bad block window start={block_start} size={block_size}")
    block_end = block_start + block_size
    return tuple(
        (span.image_hash, span.start - block_start)
        for span in spans
        if span.start < block_end and span.end > block_start
    )


def chain_hashes(
    root: BlockHash,
    tokens: Sequence[int] | np.ndarray,
    spans: Sequence[ImageSpan],
    block_size: int,
) -> list[BlockHash]:
    """Hashes of all full blocks of a token sequence.

    Args:
        root: Root digest (see ``root_hash``).
        tokens: The whole token sequence.
        spans: Image spans of the sequence.
        block_size: Tokens per block.

    Returns:
        One digest per full block, in order; a trailing partial block is not included.
    """
    check_digest(root, "root")
    token_bytes = token_array(tokens).tobytes()
    hasher = ChainHasher(root, token_bytes, spans, block_size)
    return hasher.hashes(len(token_bytes) // 4 // block_size)


class ChainHasher:
    """Hashes the full blocks of one token sequence lazily, in chain order.

    Lookup hashes block by block and stops at the first miss, so it never pays for blocks it
    cannot use; ``chain_hashes`` drains it.
    """

    __slots__ = ("_extra", "_parent", "_block_size", "_token_bytes", "_index")

    def __init__(
        self, root: BlockHash, token_bytes: bytes, spans: Sequence[ImageSpan], block_size: int
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._extra = extra_keys_by_block(spans, block_size)
        self._parent = root
        self._block_size = block_size
        self._token_bytes = memoryview(token_bytes)
        self._index = 0

    def extra(self, index: int) -> tuple[ExtraKey, ...]:
        """Extra keys of full block ``index``."""
        return self._extra.get(index, ())

    def next_hash(self) -> BlockHash:
        """Hash of the next full block (the caller checks that the block exists)."""
        i = self._index
        width = self._block_size * 4
        extra = self._extra.get(i)
        digest = hash_block_bytes(
            self._parent,
            self._token_bytes[i * width : (i + 1) * width],
            self._block_size,
            encode_extra(extra) if extra else _NO_EXTRA,
        )
        self._parent = digest
        self._index = i + 1
        return digest

    def hashes(self, count: int) -> list[BlockHash]:
        """The next ``count`` block hashes."""
        return [self.next_hash() for _ in range(count)]


def extra_keys_by_block(
    spans: Sequence[ImageSpan], block_size: int
) -> dict[int, tuple[ExtraKey, ...]]:
    """Extra keys of every full-size block window that some span overlaps.

    Equal to ``block_extra_keys(i * block_size, block_size, spans)`` for every block index
    ``i``, but costs O(blocks covered by images) instead of O(blocks * spans).
    """
    keys: dict[int, list[ExtraKey]] = {}
    for span in spans:
        for index in range(span.start // block_size, (span.end - 1) // block_size + 1):
            keys.setdefault(index, []).append((span.image_hash, span.start - index * block_size))
    return {index: tuple(found) for index, found in keys.items()}


def encode_extra(extra: tuple[ExtraKey, ...]) -> bytes:
    """Canonical, length-prefixed encoding of a block's extra keys."""
    if not extra:
        return _NO_EXTRA
    parts = [_U32.pack(len(extra))]
    for image_hash, offset in extra:
        parts.append(_U32.pack(len(image_hash)))
        parts.append(image_hash)
        parts.append(_I64.pack(offset))
    return b"".join(parts)


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a 1-D little-endian int32 array.

    Raises:
        ValueError: The ids are not a 1-D integer sequence or do not fit in int32.
    """
    if isinstance(tokens, np.ndarray):
        array = tokens
    elif isinstance(tokens, (list, tuple)):
        try:
            return np.array(tokens, dtype="<i4")
        except OverflowError as error:
            raise ValueError(f"token ids must fit in int32: {error}") from error
    else:
        # Other array types (e.g. mlx) convert through the buffer protocol.
        array = np.asarray(tokens)
    if array.ndim != 1 or not (array.dtype.kind in "iu" or array.size == 0):
        raise ValueError(
            f"token ids must be a 1-D integer sequence, got {array.dtype}{array.shape}"
        )
    if array.size and array.dtype.itemsize >= 4 and array.dtype != np.dtype("<i4"):
        low, high = int(array.min()), int(array.max())
        if low < -(2**31) or high >= 2**31:
            raise ValueError(f"token ids must fit in int32, got range [{low}, {high}]")
    return array.astype("<i4", copy=False)


def hash_block_bytes(
    parent: bytes, token_bytes: bytes | memoryview, count: int, encoded_extra: bytes
) -> BlockHash:
    """``hash_block`` over already packed tokens (``count`` int32 LE) and encoded extra keys."""
    return BlockHash(_digest(b"".join((parent, _U32.pack(count), token_bytes, encoded_extra))))


def check_digest(value: bytes, name: str) -> None:
    """Raise ValueError unless ``value`` is a 16-byte digest (``name`` goes in the message)."""
    if not isinstance(value, bytes) or len(value) != DIGEST_SIZE:
        raise ValueError(f"{name} must be a {DIGEST_SIZE}-byte digest, got {value!r}")
