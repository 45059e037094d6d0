"""Wire request -> ``GenerationRequest``: semantic validation, image decoding and hashing.

Runs in a worker thread (decoding and hashing pixels is CPU work that must not block the event
loop). Every problem becomes an ``ApiError`` 400 naming the offending field, e.g.
``messages[2].content[1].image_url``; cheap checks (roles, part types, image count) all run
before the first image is decoded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image

from server.api.errors import ApiError
from server.api.image_fetch import FetchLimits, ImageFetchError, fetch_image_bytes
from server.api.schemas import ChatCompletionRequest, ContentPart, ImageUrl, Message
from server.engine.types import ChatMessage, GenerationRequest, ImagePart, Role, SamplingParams, TextPart
from tenancy.sessions import SessionId
from tenancy.tenants import Tenant
from vision_cache.decoding import (
    CorruptImage,
    ImageDataTooLarge,
    ImageDecodeError,
    ImageTooLarge,
    InvalidBase64,
    InvalidDataUrl,
    NotAnImage,
    UnsupportedImageMode,
    decode_data_url,
    decode_image,
)
from vision_cache.hashing import image_hash

# OpenAI's "developer" role is the newer name of "system".
_ROLES: dict[str, Role] = {"system": "system", "developer": "system", "user": "user",
                           "assistant": "assistant"}

# Decoding failures -> (status, code); the most specific class in the MRO wins.
_DECODE_ERRORS: dict[type[ImageDecodeError], tuple[int, str]] = {
    InvalidBase64: (400, "invalid_base64"),
    InvalidDataUrl: (400, "invalid_image_url"),
    NotAnImage: (400, "invalid_image"),
    CorruptImage: (400, "invalid_image"),
    UnsupportedImageMode: (400, "invalid_image"),
    ImageTooLarge: (400, "image_too_large"),
    ImageDataTooLarge: (413, "image_too_large"),
    ImageDecodeError: (400, "invalid_image"),
}


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for.

    Attributes:
        max_images: most images over all messages.
        max_image_pixels: most pixels of one decoded image.
        max_image_bytes: most encoded bytes of one image.
        allow_http_images: whether http(s) image URLs are fetched for this request's tenant.
        http_timeout_s: total download time of one http image.
        max_tokens_default: completion length when the request names none.
        context_length: the model's context; ``max_tokens`` above it can never be served.
    """

    max_images: int
    max_image_pixels: int
    max_image_bytes: int
    allow_http_images: bool
    http_timeout_s: float
    max_tokens_default: int
    context_length: int


@dataclass(frozen=True, slots=True)
class _PendingImage:
    """An image part whose URL passed the cheap checks, decoded in a second pass."""

    url: str
    param: str


_Part = TextPart | _PendingImage


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _image_url(part: ContentPart, param: str) -> str:
    value = part.image_url
    if value is None:
        raise _bad("an image_url part needs an 'image_url' field", param)
    url = value.url if isinstance(value, ImageUrl) else value
    return url.strip()


def _check_image_url(url: str, param: str, allow_http: bool) -> None:
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme == "data":
        return
    if scheme in ("http", "https"):
        if not allow_http:
            raise _bad("http image URLs are disabled on this server; send the image as a "
                       "data: URL (base64)", param, "http_images_disabled")
        return
    raise _bad("image_url must be a data: URL (base64) or an http(s) URL, got "
               f"{(scheme + ':') if scheme else repr(url[:32])}", param, "invalid_image_url")


def _parts(message: Message, index: int, role: Role, allow_http: bool) -> list[_Part]:
    param = f"messages[{index}].content"
    content = message.content
    if content is None:
        if role == "assistant":
            return [TextPart("")]  # an assistant turn that only called tools has no text
        raise _bad(f"messages[{index}] ({role}) must have content", param)
    if isinstance(content, str):
        return [TextPart(content)]
    if not content:
        raise _bad(f"messages[{index}].content is an empty list", param)
    parts: list[_Part] = []
    for j, part in enumerate(content):
        part_param = f"{param}[{j}]"
        if part.type == "text":
            if part.text is None:
                raise _bad("a text part needs a 'text' field", f"{part_param}.text")
            parts.append(TextPart(part.text))
        elif part.type == "image_url":
            if role != "user":
                raise _bad(f"images are only allowed in user messages, not in {message.role}",
                           part_param)
            url = _image_url(part, f"{part_param}.image_url")
            _check_image_url(url, f"{part_param}.image_url", allow_http)
            parts.append(_PendingImage(url, f"{part_param}.image_url"))
        else:
            raise _bad(f"unsupported content part type {part.type!r}; supported: text, image_url",
                       f"{part_param}.type")
    return parts


def _decode(pending: _PendingImage, limits: RequestLimits,
            fetch: Callable[[str, FetchLimits], bytes]) -> Image.Image:
    try:
        if pending.url[:5].lower() == "data:":
            return decode_data_url(pending.url, max_bytes=limits.max_image_bytes,
                                   max_pixels=limits.max_image_pixels)
        try:
            data = fetch(pending.url, FetchLimits(limits.max_image_bytes, limits.http_timeout_s))
        except ImageFetchError as exc:
            raise _bad(str(exc), pending.param, "image_fetch_failed") from None
        return decode_image(data, max_pixels=limits.max_image_pixels)
    except ImageDecodeError as exc:
        status, code = next(_DECODE_ERRORS[c] for c in type(exc).__mro__ if c in _DECODE_ERRORS)
        raise ApiError(status, str(exc), param=pending.param, code=code) from None


def _sampling(wire: ChatCompletionRequest, limits: RequestLimits) -> SamplingParams:
    if wire.max_completion_tokens is not None:
        max_tokens, param = wire.max_completion_tokens, "max_completion_tokens"
    elif wire.max_tokens is not None:
        max_tokens, param = wire.max_tokens, "max_tokens"
    else:
        max_tokens, param = min(limits.max_tokens_default, limits.context_length), None
    if max_tokens > limits.context_length:
        raise _bad(f"{param} is {max_tokens}, more than the model's context of "
                   f"{limits.context_length} tokens", param)
    stop = (wire.stop,) if isinstance(wire.stop, str) else tuple(wire.stop or ())
    # OpenAI's defaults: temperature 1, top_p 1.
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if wire.temperature is None else wire.temperature,
        top_p=1.0 if wire.top_p is None else wire.top_p,
        seed=wire.seed,
        stop=tuple(s for s in stop if s),
    )


def to_generation_request(
    wire: ChatCompletionRequest,
    *,
    request_id: str,
    tenant: Tenant,
    session_id: SessionId | None,
    limits: RequestLimits,
    fetch: Callable[[str, FetchLimits], bytes] = fetch_image_bytes,
) -> GenerationRequest:
    """Validate a decoded wire request and turn it into the engine's request record.

    Args:
        wire: the decoded request body.
        request_id: id echoed in the response (``chatcmpl-...``).
        tenant: the authenticated tenant (its salt keys the image hashes).
        session_id: owner recorded on the blocks this request stores.
        limits: request limits.
        fetch: downloads an http(s) image (only called when ``limits.allow_http_images``).

    Raises:
        ApiError: 400 (or 413 for an oversize image) naming the offending field.
    """
    if wire.n is not None and wire.n != 1:
        raise _bad(f"only n=1 is supported, got n={wire.n}", "n")
    if not wire.messages:
        raise _bad("messages must contain at least one message", "messages")
    structured: list[tuple[Role, list[_Part]]] = []
    for i, message in enumerate(wire.messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise _bad(f"unsupported role {message.role!r} in messages[{i}]; supported: "
                       "system, developer, user, assistant", f"messages[{i}].role", "invalid_role")
        structured.append((role, _parts(message, i, role, limits.allow_http_images)))
    if not any(role == "user" for role, _ in structured):
        raise _bad("messages must contain at least one user message", "messages")
    image_count = sum(isinstance(p, _PendingImage) for _, parts in structured for p in parts)
    if image_count > limits.max_images:
        raise _bad(f"{image_count} images in one request; the limit is {limits.max_images}",
                   "messages", "too_many_images")
    sampling = _sampling(wire, limits)

    messages: list[ChatMessage] = []
    for role, parts in structured:
        resolved: list[TextPart | ImagePart] = []
        for part in parts:
            if isinstance(part, _PendingImage):
                image = _decode(part, limits, fetch)
                resolved.append(ImagePart(image=image, image_hash=image_hash(tenant.salt, image)))
            else:
                resolved.append(part)
        messages.append(ChatMessage(role=role, parts=tuple(resolved)))
    return GenerationRequest(
        request_id=request_id,
        tenant=tenant,
        session_id=session_id,
        messages=tuple(messages),
        sampling=sampling,
    )
