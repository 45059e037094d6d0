"""Image decoding: untrusted bytes or ``data:`` URLs -> a fully loaded RGB ``PIL.Image``.

The output pixels are what gets hashed (``vision_cache.hashing``), so the same picture must
always decode to the same pixels:

* EXIF orientation is applied (``ImageOps.exif_transpose``): a rotated-by-metadata JPEG and the
  same picture stored upright decode equal.
* Transparency (RGBA, LA, PA, RGBa, La, palette or RGB/L with a transparent colour) is composited
  over opaque white. Plain ``convert("RGB")`` (what mlx-vlm's loader does) would expose whatever
  colour hides under transparent pixels, often black, making a dark logo on a transparent
  background invisible; white is the background the picture was most likely meant to be seen on.
* 16-bit greyscale (``I;16*``) and 32-bit integer (``I``) images keep their top 8 of 16 bits
  (``clip(v, 0, 65535) >> 8``); Pillow's own conversion clips every value above 255 to white.
  Float (``F``) images are clipped to [0, 255] and rounded (NaN -> 0).
* Everything else (L, 1, P, CMYK, YCbCr, ...) uses Pillow's ``convert("RGB")``; ICC profiles are
  not applied (deterministic, and what the model preprocessors do anyway).
* Multi-frame files (GIF, APNG, TIFF) decode their first frame.

The pixel limit is applied to the size read from the file header, before any pixel data is
decoded. Pillow's own decompression-bomb limit (about 179 M pixels) also applies and is reported
the same way. No network fetching happens here.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# What Pillow raises for data it cannot parse, besides UnidentifiedImageError (an OSError).
_PARSE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError, TypeError)

_ALPHA_MODES = frozenset(("RGBA", "LA", "PA", "RGBa", "La"))
_INT_MODES = frozenset(("I", "I;16", "I;16L", "I;16B", "I;16N"))


class ImageDecodeError(ValueError):
    """Base of every decoding failure (the server answers 400, or 413 for oversize payloads)."""


class NotAnImage(ImageDecodeError):
    """The bytes are not an image in any format Pillow knows."""


class CorruptImage(ImageDecodeError):
    """A recognised image whose pixel data or metadata cannot be decoded (e.g. truncated)."""


class UnsupportedImageMode(ImageDecodeError):
    """An image mode with no RGB conversion."""


class ImageTooLarge(ImageDecodeError):
    """More pixels than allowed.

    Attributes:
        width: Width from the header, or None if Pillow refused the file before it could be read.
        height: Height from the header, or None likewise.
        max_pixels: The limit that was exceeded.
    """

    def __init__(self, width: int | None, height: int | None, max_pixels: int, detail: str = "") -> None:
        self.width = width
        self.height = height
        self.max_pixels = max_pixels
        if width is not None and height is not None:
            message = (
                f"image is {width}x{height} = {width * height} pixels, over the limit of "
                f"{max_pixels} pixels"
            )
        else:
            message = f"image is over the limit of {max_pixels} pixels"
        super().__init__(message + (f" ({detail})" if detail else ""))


class InvalidDataUrl(ImageDecodeError):
    """Not a ``data:image/<type>;base64,<payload>`` URL."""


class InvalidBase64(InvalidDataUrl):
    """The data URL payload is not valid base64."""


class ImageDataTooLarge(ImageDecodeError):
    """The encoded image is bigger than allowed.

    Attributes:
        size_bytes: Decoded size in bytes (a lower bound when rejected before decoding).
        max_bytes: The limit.
    """

    def __init__(self, size_bytes: int, max_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.max_bytes = max_bytes
        super().__init__(f"image data is {size_bytes} bytes, over the limit of {max_bytes} bytes")


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """Decode image bytes into a fully loaded RGB image (see the module docstring for the rules).

    Args:
        data: Encoded image (PNG, JPEG, WebP, GIF, BMP, TIFF, ... whatever Pillow reads).
        max_pixels: Most width x height accepted; checked before pixels are decoded.

    Returns:
        A loaded ``PIL.Image.Image`` in mode ``RGB``, independent of ``data``.

    Raises:
        NotAnImage: Unrecognised data.
        ImageTooLarge: Over ``max_pixels`` (or over Pillow's decompression-bomb limit).
        CorruptImage: Recognised but undecodable (truncated data, broken metadata).
        UnsupportedImageMode: A mode that cannot become RGB.
    """
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels <= 0:
        raise ValueError(f"max_pixels must be a positive integer, got {max_pixels!r}")
    if len(data) == 0:
        raise NotAnImage("image data is empty")
    try:
        # Reads only the header: the size is known here, no pixel has been decoded yet.
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        width, height = _header_size_ignoring_bomb_limit(data)
        raise ImageTooLarge(width, height, max_pixels, "Pillow decompression-bomb limit") from e
    except UnidentifiedImageError as e:
        raise NotAnImage("data is not a recognised image format") from e
    except _PARSE_ERRORS as e:
        raise NotAnImage(f"data is not a readable image: {e}") from e
    with image:
        _check_size(image.size, max_pixels)
        try:
            image.load()
        except Image.DecompressionBombError as e:
            raise ImageTooLarge(None, None, max_pixels, "Pillow decompression-bomb limit") from e
        except _PARSE_ERRORS as e:
            raise CorruptImage(f"{image.format} image cannot be decoded: {e}") from e
        # Some formats (ICO, ICNS, JPEG draft) settle on their size only when loading.
        _check_size(image.size, max_pixels)
        try:
            # Returns a copy in every case, so the result does not keep the BytesIO alive.
            oriented = ImageOps.exif_transpose(image)
        except _PARSE_ERRORS as e:
            raise CorruptImage(f"{image.format} image has unreadable EXIF metadata: {e}") from e
    assert oriented is not None
    rgb = to_rgb(oriented)
    assert rgb.mode == "RGB"
    return rgb


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert a loaded image of any mode to RGB by this module's deterministic rules.

    Args:
        image: A loaded image.

    Returns:
        The image itself when already RGB without a transparent colour, else a new RGB image.

    Raises:
        UnsupportedImageMode: When Pillow has no conversion for the mode.
    """
    mode = image.mode
    if mode in _INT_MODES or mode == "F":
        return _high_depth_to_rgb(image)
    if mode in _ALPHA_MODES or "transparency" in image.info:
        try:
            rgba = image.convert("RGBA")
        except ValueError as e:
            raise UnsupportedImageMode(f"cannot convert image mode {mode!r} to RGBA: {e}") from e
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode == "RGB":
        return image
    try:
        return image.convert("RGB")
    except ValueError as e:
        raise UnsupportedImageMode(f"cannot convert image mode {mode!r} to RGB: {e}") from e


def _high_depth_to_rgb(image: Image.Image) -> Image.Image:
    values = np.asarray(image)
    if image.mode == "F":
        grey = np.rint(np.clip(np.nan_to_num(values, nan=0.0), 0.0, 255.0)).astype(np.uint8)
    else:
        grey = (np.clip(values.astype(np.int64), 0, 65535) >> 8).astype(np.uint8)
    return Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2), "RGB")


def decode_data_url(url: str, *, max_bytes: int, max_pixels: int) -> Image.Image:
    """Decode a ``data:image/<type>;base64,<payload>`` URL.

    The declared image subtype is not trusted (the format is sniffed from the bytes); it must
    only be some ``image/...``. Missing ``=`` padding is tolerated; other non-base64 characters
    (including whitespace inside the payload) are not.

    Args:
        url: The URL.
        max_bytes: Most decoded bytes accepted; an oversize payload is refused before decoding.
        max_pixels: Passed to :func:`decode_image`.

    Returns:
        A loaded RGB image.

    Raises:
        InvalidDataUrl: Not a base64 ``data:image/...`` URL.
        InvalidBase64: Payload is not base64.
        ImageDataTooLarge: Decoded size over ``max_bytes``.
        ImageDecodeError: Any error of :func:`decode_image`.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    if url[:5].lower() != "data:":
        raise InvalidDataUrl(f"expected a data: URL, got {_preview(url)}")
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise InvalidDataUrl(f"data URL has no ',' before its payload: {_preview(url)}")
    media_type, *params = (part.strip().lower() for part in header.split(";"))
    subtype = media_type.partition("image/")[2] if media_type.startswith("image/") else ""
    if not subtype:
        raise InvalidDataUrl(f"data URL media type must be image/<type>, got {media_type!r}")
    if "base64" not in params:
        raise InvalidDataUrl(f"data URL must be base64-encoded (';base64,'), got {_preview(url)}")
    payload = payload.strip()
    # Smallest encoded length that must decode to more than max_bytes: refuse without decoding.
    max_encoded = 4 * -(-max_bytes // 3)
    if len(payload) > max_encoded:
        raise ImageDataTooLarge(len(payload) // 4 * 3, max_bytes)
    if len(payload) % 4 == 1:
        raise InvalidBase64(f"base64 payload has an impossible length ({len(payload)} characters)")
    try:
        data = base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except binascii.Error as e:
        raise InvalidBase64(f"data URL payload is not valid base64: {e}") from e
    if len(data) > max_bytes:
        raise ImageDataTooLarge(len(data), max_bytes)
    return decode_image(data, max_pixels=max_pixels)


def _check_size(size: tuple[int, int], max_pixels: int) -> None:
    width, height = size
    if width * height > max_pixels:
        raise ImageTooLarge(width, height, max_pixels)


def _header_size_ignoring_bomb_limit(data: bytes) -> tuple[int | None, int | None]:
    """Width and height from the header of an image Pillow refused as a decompression bomb.

    ``Image.open`` raises before returning the image, so the size is read again with the format
    plugins registered through Pillow's public ``register_open`` (``Image.ID`` / ``Image.OPEN``),
    whose constructors parse the header only and do not apply the bomb check. Only used to name
    the size in the error message.
    """
    prefix = data[:16]
    for format_id in Image.ID:
        factory, accept = Image.OPEN[format_id]
        if accept is not None and not accept(prefix):
            continue
        try:
            with factory(io.BytesIO(data), "") as header_only:
                return header_only.size
        except _PARSE_ERRORS:
            continue  # Same probing as Image.open: the next plugin may recognise it.
    return None, None


def _preview(url: str) -> str:
    return repr(url[:48] + ("..." if len(url) > 48 else ""))
