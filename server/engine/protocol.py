"""What the HTTP layer needs from the model engine.

The engine runs every MLX call on one thread (MLX streams are thread-local). The worker in
``server/engine/worker.py`` owns that thread and its request queue and calls ``generate`` for one
request at a time; ``generate`` reports through ``emit`` and polls ``cancelled`` between tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from server.engine.types import EngineEvent, GenerationRequest
from tenancy.tenants import Tenant


class Engine(Protocol):
    @property
    def model_id(self) -> str:
        """Name served in /v1/models and echoed in responses."""
        ...

    @property
    def context_length(self) -> int:
        """Largest prompt + completion length in tokens."""
        ...

    def generate(
        self,
        request: GenerationRequest,
        emit: Callable[[EngineEvent], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """Run one request to completion on the calling (engine) thread.

        Emits zero or more ``TokenEvent`` then exactly one ``FinishEvent`` or ``EngineError``.
        Never raises for request-level problems: they become ``EngineError`` events.
        """
        ...

    def cache_stats(self, tenant: Tenant | None) -> Mapping[str, Any]:
        """JSON-able cache statistics for one tenant, or for all tenants when None (admin)."""
        ...

    def close(self) -> None:
        """Flush background work (disk writes) and release resources; called once at shutdown
        on the engine thread."""
        ...
