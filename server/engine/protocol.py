"""What the HTTP layer needs from the model engine.

The engine runs every MLX call on one thread (MLX streams are thread-local). The worker in
``server/engine/worker.py`` owns that thread and its request queue and calls ``generate`` for one
request at a time; ``generate`` reports through ``emit`` and polls ``cancelled`` between tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from server.engine.types import EngineEvent, GenerationRequest
from tenancy.tenants import Tenant

if TYPE_CHECKING:  # the lifecycle pulls in the cache tiers; the protocol stays light
    from server.engine.lifecycle import ErasureReport, SweepReport


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

    def configure_tenants(self, tenants: Sequence[Tenant]) -> None:
        """Apply every known tenant's quotas and retention (called once at startup, so that
        retention also reaches tenants whose state is only on disk)."""
        ...

    def erase_session(self, tenant: Tenant, session_id: str) -> ErasureReport:
        """Erase the cached state only this session of the tenant owns, in every tier."""
        ...

    def erase_tenant(self, tenant: Tenant) -> ErasureReport:
        """Erase all cached state of the tenant, in every tier."""
        ...

    def sweep(self) -> SweepReport:
        """Drop cached state past its tenant's retention, in every tier (the periodic sweeper)."""
        ...

    def close(self) -> None:
        """Flush background work (disk writes) and release resources; called once at shutdown
        on the engine thread."""
        ...
