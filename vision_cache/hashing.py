"""Tenant-salted image identity."""

from __future__ import annotations

import struct
from typing import NewType

import xxhash
from PIL import Image

# xxh3_128 digest (16 bytes) of (tenant salt, width, height, mode, raw pixels).
ImageHash = NewType("ImageHash", bytes)

# Bumped if the encoding below ever changes, so old and new hashes can never coincide.
_FORMAT_TAG = b"vlmcache.image.v1\x00"


def image_hash(salt: bytes, image: Image.Image) -> ImageHash:
    """Hash an image's decoded pixels under a tenant salt.

    Pixels, not file bytes: the same picture as PNG, BMP or lossless WebP hashes equal, and a
    different salt (tenant) gives an unrelated hash. The hashed message is, in order::

        b"vlmcache.image.v1\\0"
        u32 little-endian len(salt) || salt
        u32 LE width || u32 LE height
        u8 len(mode) || mode (ASCII)
        raw pixel bytes (``image.tobytes()``, row-major, mode's packing)

    Every field before the pixels has a fixed size or a length prefix, and the pixel byte count
    follows from width, height and mode, so no two inputs share an encoding.

    Args:
        salt: Tenant salt (``Tenant.salt``).
        image: A decoded image, normally RGB from ``vision_cache.decoding``.

    Returns:
        16-byte xxh3_128 digest (canonical big-endian byte order).
    """
    if not isinstance(salt, (bytes, bytearray, memoryview)):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
    salt = bytes(salt)
    mode = image.mode.encode("ascii")
    width, height = image.size
    h = xxhash.xxh3_128()
    h.update(_FORMAT_TAG)
    h.update(struct.pack("<I", len(salt)))
    h.update(salt)
    h.update(struct.pack("<IIB", width, height, len(mode)))
    h.update(mode)
    h.update(image.tobytes())
    return ImageHash(h.digest())
