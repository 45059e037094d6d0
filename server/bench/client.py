"""One streamed chat completion, timed from the client side.

Time to first token is measured to the first streamed chunk carrying content text (a role-only
chunk a server sends before prefill does not count). A completion whose only token ends it
sends no text; its first token is then the finish chunk. ``cached_tokens`` comes from the
final usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx


class BenchError(RuntimeError):
    """The server answered something a replay cannot use (HTTP error, malformed stream)."""


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """What one request measured.

    Attributes:
        ttft_s: Seconds from sending the request to the first content token.
        total_s: Seconds from sending the request to the end of the stream.
        first_token_source: ``content`` (a text chunk) or ``finish`` (no text was streamed).
        prompt_tokens: The server's count of prompt tokens.
        cached_tokens: ``usage.prompt_tokens_details.cached_tokens`` (None if not reported).
        completion_tokens: Tokens generated.
        text: The streamed reply.
    """

    ttft_s: float
    total_s: float
    first_token_source: str
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    text: str


@dataclass(frozen=True, slots=True)
class Endpoint:
    """An OpenAI-compatible server.

    Attributes:
        url: Base URL without ``/v1`` (``http://127.0.0.1:8000``); a trailing ``/v1`` is accepted.
        api_key: Bearer key, or None.
        timeout_s: Most seconds one request may take.
    """

    url: str
    api_key: str | None = None
    timeout_s: float = 900.0

    @property
    def base(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        headers.update(extra or {})
        return headers


def served_model(client: httpx.Client, endpoint: Endpoint) -> str:
    """The first model ``GET /v1/models`` lists."""
    response = client.get(endpoint.base + "/v1/models", headers=endpoint.headers())
    if response.status_code != 200:
        raise BenchError(f"GET /v1/models answered {response.status_code}: {response.text[:300]}")
    data = response.json().get("data") or []
    if not data:
        raise BenchError(f"{endpoint.base} serves no model")
    return str(data[0]["id"])


def stream_chat(
    client: httpx.Client,
    endpoint: Endpoint,
    *,
    model: str,
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    session_id: str | None = None,
) -> TurnTiming:
    """Send one streamed, greedy chat completion and time it.

    Raises:
        BenchError: A non-200 answer, an error event, or a stream without a usage chunk.
    """
    body = {
        "model": model,
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = endpoint.headers({"X-Session-Id": session_id} if session_id else None)
    pieces: list[str] = []
    usage: Mapping[str, Any] | None = None
    first: float | None = None
    source = "content"
    started = time.perf_counter()
    with client.stream("POST", endpoint.base + "/v1/chat/completions", json=body,
                       headers=headers, timeout=endpoint.timeout_s) as response:
        if response.status_code != 200:
            raise BenchError(f"chat completion answered {response.status_code}: "
                             f"{response.read().decode(errors='replace')[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise BenchError(f"error event in the stream: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(text)
                elif choice.get("finish_reason") and first is None:
                    first, source = time.perf_counter(), "finish"
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    if usage is None:
        raise BenchError("the stream ended without a usage chunk (stream_options.include_usage)")
    if first is None:
        first, source = end, "finish"
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return TurnTiming(
        ttft_s=first - started,
        total_s=end - started,
        first_token_source=source,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=None if cached is None else int(cached),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        text="".join(pieces),
    )
