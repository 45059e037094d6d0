"""A test-only engine for the worker's unit tests (never served): it replays a script of token
texts per request and records what the worker made it do. The worker's behaviour (ordering,
cancellation, errors as values, shutdown) cannot be driven deterministically by a real model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from server.engine.types import EngineError, EngineEvent, FinishEvent, GenerationRequest, TokenEvent, Usage
from tenancy.tenants import Tenant


@dataclass
class ScriptedEngine:
    """Per request: emits ``tokens`` one by one, polling ``cancelled`` before each.

    Request ids starting with ``raise`` make ``generate`` raise, ``silent`` return without a
    final event, ``error`` emit an ``EngineError``; ``gate`` blocks until ``release`` is set.
    """

    tokens: tuple[str, ...] = ("a", "b", "c")
    model_id: str = "scripted"
    context_length: int = 64
    served: list[str] = field(default_factory=list)
    threads: set[str] = field(default_factory=set)
    gate_entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def generate(self, request: GenerationRequest, emit: Callable[[EngineEvent], None],
                 cancelled: Callable[[], bool]) -> None:
        self.threads.add(threading.current_thread().name)
        self.served.append(request.request_id)
        rid = request.request_id
        if rid.startswith("raise"):
            raise ValueError("scripted failure")
        if rid.startswith("silent"):
            return
        if rid.startswith("error"):
            emit(EngineError(400, "prompt too long", "invalid_request_error", "context_length_exceeded"))
            return
        if rid.startswith("gate"):
            self.gate_entered.set()
            self.release.wait(10)
        for n, text in enumerate(self.tokens):
            if cancelled():
                emit(FinishEvent("cancelled", Usage(3, n, 0)))
                return
            emit(TokenEvent(text, n))
        emit(FinishEvent("length", Usage(3, len(self.tokens), 1)))

    def cache_stats(self, tenant: Tenant | None) -> Mapping[str, Any]:
        return {"thread": threading.current_thread().name}
