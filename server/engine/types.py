"""Typed records that cross the boundary between the HTTP layer and the engine thread.

Wire schemas (msgspec Structs) stay in ``server/api``; handlers convert them into these plain
records, the engine consumes them and answers with the event records below, one response
channel per request. Errors travel back as values (``EngineError``), never as exceptions across
threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from PIL import Image

from vision_cache.hashing import ImageHash
from tenancy.tenants import Tenant

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """A decoded RGB image and its tenant-salted pixel hash."""

    image: Image.Image
    image_hash: ImageHash


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: Role
    parts: tuple[TextPart | ImagePart, ...]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    tenant: Tenant
    session_id: str | None
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """Newly decoded text (may be empty while a multi-byte character is incomplete)."""

    text: str
    token_id: int


@dataclass(frozen=True, slots=True)
class FinishEvent:
    finish_reason: Literal["stop", "length", "cancelled"]
    usage: Usage


@dataclass(frozen=True, slots=True)
class EngineError:
    """A failure reported back to the client. ``status`` is the HTTP status to use when
    nothing has been streamed yet (400 for a prompt longer than the context, 500 otherwise)."""

    status: int
    message: str
    type: str = "server_error"
    code: str | None = None
    param: str | None = None


EngineEvent = TokenEvent | FinishEvent | EngineError
