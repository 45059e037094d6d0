"""What route handlers need, built once in the app's lifespan and injected as dependencies.

``ServerState`` lives on ``app.state`` (one per app, no module globals); handlers receive it as
the ``server`` dependency and the authenticated caller as the ``tenant`` dependency.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request
from litestar.datastructures import State

from server.api.convert import RequestLimits
from server.api.errors import NOT_FOUND, ApiError
from server.config import ServerConfig
from server.engine.worker import EngineWorker
from tenancy.registry import TenantRegistry
from tenancy.tenants import Tenant

STATE_KEY = "vlmcache"


@dataclass(frozen=True, slots=True)
class ServerState:
    """The running server's parts.

    Attributes:
        config: the configuration the app was created with.
        registry: tenants and API keys.
        worker: the engine thread.
        served_model: model name shown in /v1/models and echoed in responses.
        model_names: names accepted in a request's ``model`` field.
        context_length: the engine's context length in tokens.
        created: Unix time the model was loaded (the ``created`` of /v1/models).
    """

    config: ServerConfig
    registry: TenantRegistry
    worker: EngineWorker
    served_model: str
    model_names: frozenset[str]
    context_length: int
    created: int

    def check_model(self, name: str) -> None:
        """Accept the served name or the engine's own model id; 404 for any other model.

        Raises:
            ApiError: 404 ``model_not_found``.
        """
        if name not in self.model_names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.served_model!r}", type=NOT_FOUND, param="model",
                           code="model_not_found")

    def limits_for(self, tenant: Tenant) -> RequestLimits:
        """Request limits of one tenant.

        http(s) image URLs need the server-wide switch, and, when a keys file is in use, the
        tenant's own ``allow_http_images`` too. Without a keys file the single tenant is the
        operator's, so the server switch alone decides.
        """
        config = self.config
        allow_http = config.allow_http_images and (
            not self.registry.requires_auth or tenant.settings.allow_http_images)
        return RequestLimits(
            max_images=config.max_images,
            max_image_pixels=config.max_image_pixels,
            max_image_bytes=config.max_image_bytes,
            allow_http_images=allow_http,
            http_timeout_s=config.http_image_timeout_s,
            max_tokens_default=config.engine.max_tokens_default,
            context_length=self.context_length,
        )


def attach(state: State, server: ServerState) -> None:
    state[STATE_KEY] = server


def detach(state: State) -> None:
    state.pop(STATE_KEY, None)


def provide_server(request: Request[Any, Any, Any]) -> ServerState:
    """Dependency ``server``: the app's ``ServerState``."""
    server = request.app.state.get(STATE_KEY)
    if server is None:
        raise ApiError(503, "the server is starting or stopping", type="server_error",
                       code="unavailable")
    return server


def provide_tenant(request: Request[Any, Any, Any], server: ServerState) -> Tenant:
    """Dependency ``tenant``: the caller, from ``Authorization: Bearer <key>``.

    Raises:
        tenancy.errors.AuthError: 401 (handled into the OpenAI envelope).
    """
    return server.registry.authenticate(request.headers.get("authorization"))
