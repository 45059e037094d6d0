"""``DELETE /v1/cache/sessions/{session_id}`` and ``DELETE /v1/cache``: erasure of cached state.

A session is erased within the caller's tenant: the KV blocks and vision features only that
session owns go from RAM and the SSD tier (files unlinked, index rows deleted), and the replies it
generated from the reply ledger; state another session of the tenant also owns stays (a shared
system prompt). ``DELETE /v1/cache`` erases the caller's whole tenant; an admin may name another
tenant with ``?tenant=ID`` (a non-admin naming another tenant gets 403). The erasure runs on the
engine thread between requests, so no request sees half of it; the response counts what each
tier removed.
"""

from __future__ import annotations

import msgspec
from litestar import MediaType, Response, delete
from litestar.params import Parameter

from kv_cache.tally import Tally
from server.api.errors import ApiError
from server.api.state import ServerState
from server.engine.lifecycle import ErasureReport
from tenancy.registry import require_admin
from tenancy.sessions import InvalidSessionId, resolve_session_id
from tenancy.tenants import Tenant


class TierCount(msgspec.Struct):
    """Entries one tier removed and their bytes (RAM bytes, or file bytes for the SSD tier)."""

    count: int
    bytes: int


class ErasureTiers(msgspec.Struct):
    kv_ram: TierCount
    kv_ssd: TierCount
    vision_ram: TierCount
    vision_ssd: TierCount


class CacheErasure(msgspec.Struct):
    """The response of an erasure."""

    tenant: str
    session: str | None
    tiers: ErasureTiers
    kept_shared_blocks: int
    kept_shared_features: int
    replies: int
    object: str = "cache.erasure"


def _wire(report: ErasureReport) -> CacheErasure:
    def count(tally: Tally) -> TierCount:
        return TierCount(tally.count, tally.nbytes)

    return CacheErasure(
        tenant=report.tenant,
        session=report.session,
        tiers=ErasureTiers(count(report.kv_ram), count(report.kv_ssd), count(report.vision_ram),
                           count(report.vision_ssd)),
        kept_shared_blocks=report.kept_shared_blocks,
        kept_shared_features=report.kept_shared_features,
        replies=report.replies,
    )


def _json(body: CacheErasure) -> Response[bytes]:
    return Response(content=msgspec.json.encode(body), status_code=200, media_type=MediaType.JSON)


@delete("/v1/cache/sessions/{session_id:str}", status_code=200)
async def erase_session(session_id: str, server: ServerState, tenant: Tenant) -> Response[bytes]:
    """Erase what one session of the caller's tenant alone holds, in every tier."""
    try:
        session = resolve_session_id(session_id, None, None)
    except InvalidSessionId as exc:
        raise ApiError(400, str(exc), param="session_id", code="invalid_session_id") from None
    if session is None:
        raise ApiError(400, "the session id is empty", param="session_id", code="invalid_session_id")
    report = await server.worker.call(lambda engine: engine.erase_session(tenant, session))
    return _json(_wire(report))


@delete("/v1/cache", status_code=200)
async def erase_tenant(
    server: ServerState,
    tenant: Tenant,
    tenant_filter: str | None = Parameter(query="tenant", default=None, required=False),
) -> Response[bytes]:
    """Erase the caller's whole tenant; an admin may name any tenant with ``?tenant=``."""
    target = tenant
    if tenant_filter is not None and tenant_filter != tenant.tenant_id:
        require_admin(tenant)
        target = server.registry.get(tenant_filter)
    report = await server.worker.call(lambda engine: engine.erase_tenant(target))
    return _json(_wire(report))
