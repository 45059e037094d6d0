from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from vision_cache.decoding import (
    CorruptImage,
    ImageDataTooLarge,
    ImageDecodeError,
    ImageTooLarge,
    InvalidBase64,
    InvalidDataUrl,
    NotAnImage,
    decode_data_url,
    decode_image,
)

MAX_PIXELS = 1_000_000


def _rgb_image(width: int = 4, height: int = 3) -> Image.Image:
    values = (np.arange(width * height * 3, dtype=np.uint16) * 7 % 256).astype(np.uint8)
    return Image.fromarray(values.reshape(height, width, 3), "RGB")


def _encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height RGB; its IDAT is far too short."""
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + _png_chunk(b"IEND", b"")
    )


def _pixels(image: Image.Image) -> list:
    return np.asarray(image).tolist()


def test_png_rgb_roundtrip() -> None:
    original = _rgb_image()
    decoded = decode_image(_encode(original, "PNG"), max_pixels=MAX_PIXELS)
    assert decoded.mode == "RGB"
    assert decoded.size == (4, 3)
    assert decoded.tobytes() == original.tobytes()


def test_jpeg_decodes_to_rgb_deterministically() -> None:
    data = _encode(_rgb_image(16, 8), "JPEG", quality=90)
    first = decode_image(data, max_pixels=MAX_PIXELS)
    second = decode_image(data, max_pixels=MAX_PIXELS)
    assert first.mode == "RGB" and first.size == (16, 8)
    assert first.tobytes() == second.tobytes()


def test_rgba_composited_over_white() -> None:
    rgba = Image.new("RGBA", (4, 1))
    rgba.putdata([(255, 0, 0, 0), (0, 0, 0, 255), (0, 0, 0, 128), (10, 20, 30, 255)])
    decoded = decode_image(_encode(rgba, "PNG"), max_pixels=MAX_PIXELS)
    assert decoded.mode == "RGB"
    assert _pixels(decoded) == [[[255, 255, 255], [0, 0, 0], [127, 127, 127], [10, 20, 30]]]


def test_la_composited_over_white() -> None:
    la = Image.new("LA", (2, 1))
    la.putdata([(0, 0), (50, 255)])
    decoded = decode_image(_encode(la, "PNG"), max_pixels=MAX_PIXELS)
    assert _pixels(decoded) == [[[255, 255, 255], [50, 50, 50]]]


def test_palette_without_and_with_transparency() -> None:
    pal = Image.new("P", (2, 1))
    pal.putpalette([255, 0, 0, 0, 0, 255] + [0] * (256 * 3 - 6))
    pal.putdata([0, 1])
    assert _pixels(decode_image(_encode(pal, "PNG"), max_pixels=MAX_PIXELS)) == [
        [[255, 0, 0], [0, 0, 255]]
    ]
    transparent = _encode(pal, "PNG", transparency=0)
    assert _pixels(decode_image(transparent, max_pixels=MAX_PIXELS)) == [
        [[255, 255, 255], [0, 0, 255]]
    ]
    gif = decode_image(_encode(pal, "GIF"), max_pixels=MAX_PIXELS)
    assert _pixels(gif) == [[[255, 0, 0], [0, 0, 255]]]


def test_16_bit_greyscale_keeps_high_byte() -> None:
    values = np.array([[0, 255, 256, 4000, 65535]], dtype=np.uint16)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    decoded = decode_image(_encode(image, "PNG"), max_pixels=MAX_PIXELS)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded)[0, :, 0].tolist() == [0, 0, 1, 15, 255]
    assert np.asarray(decoded)[0].tolist() == [[v, v, v] for v in [0, 0, 1, 15, 255]]


def test_greyscale_and_cmyk_convert() -> None:
    grey = Image.new("L", (2, 1))
    grey.putdata([0, 200])
    assert _pixels(decode_image(_encode(grey, "PNG"), max_pixels=MAX_PIXELS)) == [
        [[0, 0, 0], [200, 200, 200]]
    ]
    cmyk = Image.new("CMYK", (1, 1), (0, 255, 255, 0))
    assert _pixels(decode_image(_encode(cmyk, "TIFF"), max_pixels=MAX_PIXELS)) == [[[255, 0, 0]]]


def test_exif_orientation_applied() -> None:
    upright = _rgb_image(3, 2)
    # Stored rotated; EXIF orientation 6 says "rotate 90 degrees clockwise to display".
    stored = upright.transpose(Image.Transpose.ROTATE_90)
    exif = Image.Exif()
    exif[0x0112] = 6
    decoded = decode_image(_encode(stored, "PNG", exif=exif), max_pixels=MAX_PIXELS)
    assert decoded.size == (3, 2)
    assert decoded.tobytes() == upright.tobytes()


@pytest.mark.parametrize("data", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n", bytes(range(256)) * 4])
def test_garbage_is_not_an_image(data: bytes) -> None:
    with pytest.raises(NotAnImage):
        decode_image(data, max_pixels=MAX_PIXELS)


def test_truncated_png_is_corrupt() -> None:
    data = _encode(_rgb_image(64, 64), "PNG")
    with pytest.raises(CorruptImage, match="PNG image cannot be decoded"):
        decode_image(data[: len(data) // 2], max_pixels=MAX_PIXELS)


def test_huge_header_rejected_by_pillow_bomb_limit_names_size() -> None:
    data = _png_claiming(100_000, 100_000)
    assert len(data) < 100
    with pytest.raises(ImageTooLarge, match=r"100000x100000 = 10000000000 pixels, over the limit of 1000000") as info:
        decode_image(data, max_pixels=MAX_PIXELS)
    assert (info.value.width, info.value.height, info.value.max_pixels) == (100_000, 100_000, MAX_PIXELS)


def test_limit_checked_before_pixels_are_decoded() -> None:
    # Under Pillow's own limit, over ours. Decoding the (missing) pixel data would raise
    # CorruptImage; getting ImageTooLarge shows the header size was checked first.
    data = _png_claiming(2000, 1000)
    with pytest.raises(ImageTooLarge, match=r"^image is 2000x1000 = 2000000 pixels, over the limit of 1000000 pixels$"):
        decode_image(data, max_pixels=MAX_PIXELS)
    with pytest.raises(CorruptImage):
        decode_image(data, max_pixels=2_000_000)


def test_exactly_at_limit_is_accepted() -> None:
    image = _rgb_image(10, 10)
    assert decode_image(_encode(image, "PNG"), max_pixels=100).size == (10, 10)
    with pytest.raises(ImageTooLarge, match="10x10 = 100 pixels, over the limit of 99"):
        decode_image(_encode(image, "PNG"), max_pixels=99)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_pixels(bad) -> None:
    with pytest.raises(ValueError, match="max_pixels must be a positive integer"):
        decode_image(b"x", max_pixels=bad)


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


def test_data_url_good() -> None:
    original = _rgb_image()
    data = _encode(original, "PNG")
    decoded = decode_data_url(_data_url(data), max_bytes=len(data), max_pixels=MAX_PIXELS)
    assert decoded.tobytes() == original.tobytes()


def test_data_url_media_type_not_trusted_but_must_be_image() -> None:
    data = _encode(_rgb_image(), "PNG")
    # Declared JPEG, actually PNG: the bytes decide.
    assert decode_data_url(_data_url(data, "image/jpeg"), max_bytes=10**6, max_pixels=MAX_PIXELS).size == (4, 3)
    assert decode_data_url(_data_url(data, "IMAGE/PNG"), max_bytes=10**6, max_pixels=MAX_PIXELS).size == (4, 3)


def test_data_url_unpadded_base64_accepted() -> None:
    data = _encode(_rgb_image(), "PNG")
    padded = _data_url(data)
    assert padded.endswith("=")
    url = padded.rstrip("=")
    assert decode_data_url(url, max_bytes=10**6, max_pixels=MAX_PIXELS).size == (4, 3)


@pytest.mark.parametrize(
    ("url", "error", "message"),
    [
        ("https://example.com/a.png", InvalidDataUrl, "expected a data: URL"),
        ("data:image/png;base64", InvalidDataUrl, "no ','"),
        ("data:text/plain;base64,aGVsbG8=", InvalidDataUrl, "media type must be image/<type>, got 'text/plain'"),
        ("data:;base64,aGVsbG8=", InvalidDataUrl, "media type must be image/<type>, got ''"),
        ("data:image/;base64,aGVsbG8=", InvalidDataUrl, "got 'image/'"),
        ("data:image/png,%89PNG", InvalidDataUrl, "must be base64-encoded"),
        ("data:image/png;base64,@@@@", InvalidBase64, "not valid base64"),
        ("data:image/png;base64,aGVs bG8", InvalidBase64, "not valid base64"),
        ("data:image/png;base64,aGVsb", InvalidBase64, "impossible length"),
        ("data:image/png;base64,aGVsbG8=", NotAnImage, "not a recognised image"),
    ],
)
def test_data_url_errors(url: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message) as info:
        decode_data_url(url, max_bytes=10**6, max_pixels=MAX_PIXELS)
    assert isinstance(info.value, ImageDecodeError)


def test_data_url_over_max_bytes() -> None:
    data = _encode(_rgb_image(), "PNG")
    url = _data_url(data)
    with pytest.raises(ImageDataTooLarge, match=f"image data is {len(data)} bytes, over the limit of {len(data) - 1} bytes"):
        decode_data_url(url, max_bytes=len(data) - 1, max_pixels=MAX_PIXELS)
    # Far over: refused from the encoded length, before decoding.
    with pytest.raises(ImageDataTooLarge, match="over the limit of 10 bytes") as info:
        decode_data_url("data:image/png;base64," + "A" * 4000, max_bytes=10, max_pixels=MAX_PIXELS)
    assert info.value.size_bytes == 3000
