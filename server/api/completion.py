"""One completion as the HTTP layer sees it: engine events -> text pieces and an outcome.

Stop strings are applied here, on the decoded text: text that might start a stop string is held
back, and once one is found the engine is told to stop (the channel is cancelled) and its final
event only supplies the usage. Shared by the streaming and the non-streaming responses.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from server.api.stop import StopMatcher
from server.engine.types import EngineError, FinishEvent, TokenEvent, Usage
from server.engine.worker import ResponseChannel


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a completion ended, with OpenAI's ``finish_reason`` ("stop" or "length")."""

    finish_reason: str
    usage: Usage


CompletionItem = str | Outcome | EngineError
"""Yielded by ``completion_items``: text to send, then one ``Outcome`` or ``EngineError``."""

_CANCELLED = EngineError(status=503, message="generation was cancelled before it finished",
                         type="server_error", code="cancelled")


async def completion_items(channel: ResponseChannel, stops: Sequence[str]) -> AsyncIterator[CompletionItem]:
    """Text pieces (never empty) and then exactly one ``Outcome`` or ``EngineError``.

    If the consumer stops iterating early (client gone), the generation is cancelled.
    """
    matcher = StopMatcher(stops)
    try:
        async for event in channel.events():
            if isinstance(event, TokenEvent):
                if matcher.stopped:
                    continue  # tokens decoded before the engine saw the cancellation
                scan = matcher.feed(event.text)
                if scan.text:
                    yield scan.text
                if scan.stopped:
                    channel.cancel()
            elif isinstance(event, FinishEvent):
                if matcher.stopped:
                    yield Outcome("stop", event.usage)
                elif event.finish_reason == "cancelled":
                    # Not cancelled by a stop string and the client is still here: shutdown.
                    yield _CANCELLED
                else:
                    tail = matcher.flush()
                    if tail:
                        yield tail
                    yield Outcome(event.finish_reason, event.usage)
            else:
                assert isinstance(event, EngineError), f"unexpected engine event {event!r}"
                yield event
    finally:
        if not channel.finished:
            channel.cancel()
