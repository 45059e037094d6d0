"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` ... ``data: [DONE]\\n\\n``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec

from server.api.completion import CompletionItem, Outcome
from server.api.errors import ApiError
from server.api.schemas import ChatCompletionChunk, ChunkChoice, Delta, PromptTokensDetails, UsageBody
from server.engine.types import EngineError, Usage

DONE = b"data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def encode_event(payload: msgspec.Struct) -> bytes:
    """One SSE event carrying ``payload`` as JSON."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def usage_body(usage: Usage) -> UsageBody:
    return UsageBody(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


class ChunkFactory:
    """Builds the chunks of one stream (same id, created and model on every chunk)."""

    __slots__ = ("_id", "_created", "_model", "_include_usage")

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool) -> None:
        self._id = completion_id
        self._created = created
        self._model = model
        self._include_usage = include_usage

    def _chunk(self, choices: list[ChunkChoice], usage: UsageBody | None = None) -> bytes:
        chunk = ChatCompletionChunk(id=self._id, created=self._created, model=self._model,
                                    choices=choices)
        if self._include_usage:
            chunk.usage = usage
        return encode_event(chunk)

    def role(self) -> bytes:
        return self._chunk([ChunkChoice(index=0, delta=Delta(role="assistant", content=""))])

    def content(self, text: str) -> bytes:
        return self._chunk([ChunkChoice(index=0, delta=Delta(content=text))])

    def finish(self, finish_reason: str) -> bytes:
        return self._chunk([ChunkChoice(index=0, delta=Delta(), finish_reason=finish_reason)])

    def usage(self, usage: Usage) -> bytes | None:
        """The final usage chunk (empty choices), or None when the client did not ask for it."""
        if not self._include_usage:
            return None
        return self._chunk([], usage_body(usage))


async def sse_stream(first: CompletionItem, rest: AsyncIterator[CompletionItem],
                     chunks: ChunkFactory) -> AsyncIterator[bytes]:
    """The event stream of one completion whose first item is already known (not an error).

    A failure after the stream has begun becomes an ``data: {"error": {...}}`` event, and the
    stream ends without ``[DONE]``. Closing this generator (client gone) closes ``rest``,
    which cancels the generation.
    """
    try:
        yield chunks.role()
        item = first
        while True:
            if isinstance(item, str):
                yield chunks.content(item)
            elif isinstance(item, Outcome):
                yield chunks.finish(item.finish_reason)
                usage = chunks.usage(item.usage)
                if usage is not None:
                    yield usage
                yield DONE
                return
            else:
                assert isinstance(item, EngineError), f"unexpected completion item {item!r}"
                yield encode_event(ApiError.from_engine(item).envelope())
                return
            item = await anext(rest)
    finally:
        await rest.aclose()  # type: ignore[attr-defined]
