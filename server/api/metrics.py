"""``GET /metrics``: the app's Prometheus metrics in the text exposition format."""

from __future__ import annotations

from litestar import Response, get

from server.metrics import CONTENT_TYPE, ServerMetrics
from tenancy.registry import require_admin
from tenancy.tenants import Tenant


@get("/metrics")
async def prometheus_metrics(tenant: Tenant, metrics: ServerMetrics) -> Response[bytes]:
    """Every metric of this server (admin only when API keys are configured: the totals cover
    all tenants). Without a keys file the single tenant is the operator's, so no key is needed.
    """
    require_admin(tenant)
    return Response(content=metrics.render(), media_type=CONTENT_TYPE)
