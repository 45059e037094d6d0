from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import xxhash
from PIL import Image

from vision_cache.decoding import decode_image
from vision_cache.hashing import image_hash

SALT_A = b"A" * 32
SALT_B = b"B" * 32


def _picture(width: int = 9, height: int = 7) -> Image.Image:
    rng = np.random.default_rng(1234)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _decoded(data: bytes) -> Image.Image:
    return decode_image(data, max_pixels=1_000_000)


def test_golden_value_2x2() -> None:
    image = Image.frombytes("RGB", (2, 2), bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255]))
    digest = image_hash(b"salt", image)
    assert digest.hex() == "0860eef255a0d6d65e5bc0bad21c1a26"
    assert len(digest) == 16
    # The documented encoding, spelled out.
    message = (
        b"vlmcache.image.v1\x00"
        + struct.pack("<I", 4) + b"salt"
        + struct.pack("<IIB", 2, 2, 3) + b"RGB"
        + bytes([255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255])
    )
    assert digest == xxhash.xxh3_128_digest(message)


@pytest.mark.parametrize(
    ("fmt", "kwargs"),
    [("BMP", {}), ("TIFF", {}), ("WEBP", {"lossless": True}), ("PPM", {}), ("PNG", {"compress_level": 0})],
)
def test_same_pixels_in_lossless_formats_hash_equal(fmt: str, kwargs: dict) -> None:
    picture = _picture()
    png = image_hash(SALT_A, _decoded(_encode(picture, "PNG")))
    other = image_hash(SALT_A, _decoded(_encode(picture, fmt, **kwargs)))
    assert other == png
    assert png == image_hash(SALT_A, picture)


def test_opaque_rgba_equals_rgb() -> None:
    picture = _picture()
    rgba = picture.convert("RGBA")
    assert image_hash(SALT_A, _decoded(_encode(rgba, "PNG"))) == image_hash(SALT_A, _decoded(_encode(picture, "PNG")))


def test_different_salt_differs() -> None:
    picture = _picture()
    assert image_hash(SALT_A, picture) != image_hash(SALT_B, picture)
    assert image_hash(SALT_A, picture) == image_hash(bytearray(SALT_A), picture)


def test_one_pixel_changed_differs() -> None:
    picture = _picture()
    changed = picture.copy()
    r, g, b = changed.getpixel((3, 3))
    changed.putpixel((3, 3), ((r + 1) % 256, g, b))
    assert image_hash(SALT_A, picture) != image_hash(SALT_A, changed)


def test_same_bytes_different_shape_or_mode_differ() -> None:
    raw = bytes(range(36))
    wide = Image.frombytes("RGB", (6, 2), raw)
    tall = Image.frombytes("RGB", (2, 6), raw)
    grey = Image.frombytes("L", (6, 6), raw)
    hashes = {image_hash(SALT_A, im) for im in (wide, tall, grey)}
    assert len(hashes) == 3


def test_salt_boundary_is_unambiguous() -> None:
    # Moving a byte between salt and what follows must change the hash (length prefix).
    image = Image.frombytes("L", (1, 1), b"\x00")
    assert image_hash(b"ab", image) != image_hash(b"ab\x01", image)
    assert image_hash(b"", image) != image_hash(b"\x00", image)


def test_salt_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="salt must be bytes, got str"):
        image_hash("salt", _picture())  # type: ignore[arg-type]
