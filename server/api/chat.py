"""``POST /v1/chat/completions``: OpenAI chat completions, plain and streamed.

Order of checks: authentication (dependency), body size (413, enforced by Litestar while the
body is read, before any parsing), JSON (400) and types (422), model name (404), semantics and
images (400), then the engine. A streamed request keeps the HTTP status open until the engine's
first event: an error before any token (e.g. a prompt longer than the context) is a plain HTTP
error; one after it is an SSE error event.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import msgspec
from litestar import MediaType, Request, Response, post
from litestar.response import Stream

from server.api.body import decode_body
from server.api.completion import CompletionItem, Outcome, completion_items
from server.api.convert import to_generation_request
from server.api.errors import ApiError
from server.api.schemas import AssistantMessage, ChatCompletion, ChatCompletionRequest, Choice
from server.api.sse import HEADERS, ChunkFactory, sse_stream, usage_body
from server.api.state import ServerState
from server.engine.types import EngineError
from server.engine.worker import ResponseChannel
from server.metrics import ServerMetrics
from tenancy.sessions import InvalidSessionId, resolve_session_id
from tenancy.tenants import Tenant


@asynccontextmanager
async def _cancel_on_disconnect(request: Request[Any, Any, Any], channel: ResponseChannel) -> AsyncIterator[None]:
    """Cancel the generation if the client disconnects while the handler waits for it.

    Only used while the handler itself awaits the engine; once a streaming response starts,
    Litestar's own disconnect listener takes over (it cancels the stream, which cancels the
    generation).
    """

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                channel.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        # Wait without re-raising the watcher's CancelledError: only one task may wait on
        # `receive` once the response starts.
        await asyncio.wait([watcher])


def _session_id(request: Request[Any, Any, Any], wire: ChatCompletionRequest) -> str | None:
    try:
        return resolve_session_id(request.headers.get("x-session-id"), wire.prompt_cache_key,
                                  wire.user)
    except InvalidSessionId as exc:
        raise ApiError(400, str(exc), param=exc.source, code="invalid_session_id") from None


async def _complete(request: Request[Any, Any, Any], channel: ResponseChannel,
                    items: AsyncIterator[CompletionItem], completion_id: str, created: int,
                    model: str) -> Response[bytes]:
    pieces: list[str] = []
    outcome: Outcome | None = None
    async with _cancel_on_disconnect(request, channel), aclosing(items):
        async for item in items:
            if isinstance(item, str):
                pieces.append(item)
            elif isinstance(item, EngineError):
                raise ApiError.from_engine(item)
            else:
                outcome = item
    assert outcome is not None, "completion ended without an outcome"
    body = ChatCompletion(
        id=completion_id,
        created=created,
        model=model,
        choices=[Choice(index=0, message=AssistantMessage(role="assistant", content="".join(pieces)),
                        finish_reason=outcome.finish_reason)],
        usage=usage_body(outcome.usage),
    )
    return Response(content=msgspec.json.encode(body), media_type=MediaType.JSON)


async def _stream(request: Request[Any, Any, Any], channel: ResponseChannel,
                  items: AsyncIterator[CompletionItem], chunks: ChunkFactory) -> Stream:
    async with _cancel_on_disconnect(request, channel):
        try:
            first = await anext(items)
        except BaseException:
            await items.aclose()  # type: ignore[attr-defined]
            raise
    if isinstance(first, EngineError):
        await items.aclose()  # type: ignore[attr-defined]
        raise ApiError.from_engine(first)
    return Stream(sse_stream(first, items, chunks), media_type="text/event-stream", headers=HEADERS)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any], server: ServerState,
                           tenant: Tenant, metrics: ServerMetrics) -> Response[bytes] | Stream:
    """OpenAI chat completions with text and image parts; ``stream=true`` answers SSE."""
    started = time.perf_counter()
    wire = decode_body(await request.body(), ChatCompletionRequest)
    server.check_model(wire.model)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = await asyncio.to_thread(
        to_generation_request, wire, request_id=completion_id, tenant=tenant,
        session_id=_session_id(request, wire), limits=server.limits_for(tenant))
    channel = server.worker.submit(generation)
    items = metrics.observe_completion(completion_items(channel, generation.sampling.stop),
                                       started)
    created = int(time.time())
    if wire.stream:
        include_usage = bool(wire.stream_options and wire.stream_options.include_usage)
        chunks = ChunkFactory(completion_id, created, server.served_model, include_usage)
        return await _stream(request, channel, items, chunks)
    return await _complete(request, channel, items, completion_id, created, server.served_model)
