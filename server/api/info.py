"""``GET /v1/models``, ``GET /v1/models/{model}``, ``GET /health`` and ``GET /v1/cache/stats``."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import MediaType, Response, get
from litestar.params import Parameter

from server.api.errors import NOT_FOUND, ApiError
from server.api.schemas import ModelCard, ModelList
from server.api.state import ServerState
from tenancy.registry import require_admin
from tenancy.tenants import Tenant


def _json(payload: Any, status: int = 200) -> Response[bytes]:
    return Response(content=msgspec.json.encode(payload), status_code=status,
                    media_type=MediaType.JSON)


@get("/v1/models")
async def list_models(server: ServerState, tenant: Tenant) -> Response[bytes]:
    """The one served model, in OpenAI's list shape."""
    return _json(ModelList(data=[ModelCard(id=server.served_model, created=server.created)]))


@get("/v1/models/{model:str}")
async def retrieve_model(model: str, server: ServerState, tenant: Tenant) -> Response[bytes]:
    """One model by name (any accepted name); 404 ``model_not_found`` otherwise."""
    if model not in server.model_names:
        raise ApiError(404, f"the model {model!r} does not exist", type=NOT_FOUND, param="model",
                       code="model_not_found")
    return _json(ModelCard(id=server.served_model, created=server.created))


@get("/health")
async def health(server: ServerState) -> Response[bytes]:
    """Liveness without authentication: 200 while the engine thread runs, else 503."""
    alive = server.worker.alive
    return _json({"status": "ok" if alive else "unavailable", "model": server.served_model,
                  "queued_requests": server.worker.pending}, 200 if alive else 503)


@get("/v1/cache/stats")
async def cache_stats(
    server: ServerState,
    tenant: Tenant,
    tenant_filter: str | None = Parameter(query="tenant", default=None, required=False),
) -> Response[bytes]:
    """Cache statistics of the caller's tenant.

    An admin without ``?tenant=`` sees every tenant; with ``?tenant=ID``, that tenant. A
    non-admin may only name itself (403 otherwise).
    """
    if tenant_filter is None:
        target: Tenant | None = None if tenant.is_admin else tenant
    elif tenant_filter == tenant.tenant_id:
        target = tenant
    else:
        require_admin(tenant)
        target = server.registry.get(tenant_filter)
    # Stats read the engine's cache structures: read them on the engine thread, between requests.
    stats = await server.worker.call(lambda engine: dict(engine.cache_stats(target)))
    return _json({"object": "cache.stats", "model": server.served_model,
                  "tenant": None if target is None else target.tenant_id, "stats": stats})
