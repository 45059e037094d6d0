"""Wire schemas of the OpenAI chat-completions API (msgspec Structs; they stay in ``server/``).

Requests are decoded strictly by type (a wrong type is a 422) but leniently by shape: unknown
fields are ignored and most fields may be null. Semantic checks (roles, part types, limits)
happen in ``server.api.convert`` and answer 400. Responses mirror OpenAI's JSON field for field.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

# --- requests -----------------------------------------------------------------------------


class ImageUrl(Struct):
    url: str
    detail: str | None = None


class ContentPart(Struct):
    """One part of a message's content; ``type`` decides which other field is required."""

    type: str
    text: str | None = None
    # Some clients send the URL as a bare string instead of {"url": ...}.
    image_url: ImageUrl | str | None = None


class Message(Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(Struct):
    include_usage: bool | None = None


class ChatCompletionRequest(Struct):
    model: str
    messages: list[Message]
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None


# --- responses ----------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class UsageBody(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(Struct):
    role: Literal["assistant"]
    content: str
    refusal: None = None


class Choice(Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(Struct, kw_only=True):
    # kw_only lets the fields keep OpenAI's order in the JSON (defaults may come first).
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: UsageBody
    system_fingerprint: str | None = None


class Delta(Struct, omit_defaults=True):
    """A streamed message delta; the final chunk's delta is ``{}``."""

    role: str | None = None
    content: str | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct, kw_only=True):
    """One SSE chunk. ``usage`` (UNSET fields are never encoded) is absent unless ``stream_options.include_usage`` asked for it,
    in which case it is null on every chunk but the last, which has empty ``choices``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: UsageBody | None | UnsetType = UNSET


class ModelCard(Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vlmcache"


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]

