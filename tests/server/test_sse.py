"""SSE framing and the completion pipeline (stop strings, mid-stream errors) without HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from server.api.completion import CompletionItem, Outcome, completion_items
from server.api.sse import DONE, ChunkFactory, sse_stream
from server.engine.types import EngineError, GenerationRequest, SamplingParams, Usage
from server.engine.worker import EngineWorker
from tenancy.tenants import make_tenant
from tests.server.scripted_engine import ScriptedEngine

USAGE = Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=4)


async def _items(*items: CompletionItem) -> AsyncIterator[CompletionItem]:
    for item in items:
        yield item


def _events(*items: CompletionItem, include_usage: bool = False) -> list[bytes]:
    async def main() -> list[bytes]:
        first, *rest = items
        chunks = ChunkFactory("chatcmpl-1", 1700000000, "m", include_usage)
        return [e async for e in sse_stream(first, _items(*rest), chunks)]

    return asyncio.run(main())


def _json(event: bytes) -> dict:
    assert event.startswith(b"data: ") and event.endswith(b"\n\n"), event
    return json.loads(event[6:-2])


def test_stream_shape_with_usage() -> None:
    events = _events("Hel", "lo", Outcome("length", USAGE), include_usage=True)
    assert events[-1] == DONE == b"data: [DONE]\n\n"
    role, hel, lo, finish, usage = (_json(e) for e in events[:-1])
    assert role == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000,
                    "model": "m", "system_fingerprint": None, "usage": None,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}
    assert hel["choices"][0]["delta"] == {"content": "Hel"}
    assert lo["choices"][0]["delta"] == {"content": "lo"}
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                              "prompt_tokens_details": {"cached_tokens": 4}}


def test_stream_without_usage_omits_the_field() -> None:
    events = _events("x", Outcome("stop", USAGE))
    assert len(events) == 4
    assert all("usage" not in _json(e) for e in events[:-1])


def test_mid_stream_error_is_an_error_event_and_the_end() -> None:
    error = EngineError(500, "boom", "server_error", "engine_error")
    events = _events("partial", error, "never sent")
    assert [_json(e) for e in events[1:]] == [
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
         "system_fingerprint": None,
         "choices": [{"index": 0, "delta": {"content": "partial"}, "logprobs": None, "finish_reason": None}]},
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": "engine_error"}},
    ]


def _complete(stops: tuple[str, ...], engine: ScriptedEngine) -> list[CompletionItem]:
    async def main() -> list[CompletionItem]:
        worker = EngineWorker(lambda: engine)
        await worker.start()
        request = GenerationRequest("r", make_tenant(b"k" * 32, "t"), None, (),
                                    SamplingParams(stop=stops))
        items = [i async for i in completion_items(worker.submit(request), stops)]
        await asyncio.to_thread(worker.stop)
        return items

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_completion_items_apply_stop_and_cancel_the_engine() -> None:
    total = 4 + 200_000
    engine = ScriptedEngine(tokens=("He", "llo", " wo", "rld") + ("!",) * 200_000)
    items = _complete(("o w",), engine)
    assert items[:-1] == ["He", "ll"]
    outcome = items[-1]
    assert isinstance(outcome, Outcome) and outcome.finish_reason == "stop"
    # The engine was cancelled after the stop string, before its last token.
    assert outcome.usage.completion_tokens < total


def test_completion_items_flush_held_text_at_the_end() -> None:
    items = _complete(("c!",), ScriptedEngine(tokens=("a", "b", "c")))
    assert items == ["a", "b", "c", Outcome("length", Usage(3, 3, 1))]
