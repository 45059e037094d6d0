"""The Litestar application: routes, error handling and the lifespan that owns the engine.

Everything the handlers use is built in the lifespan (secret, tenant registry, engine thread)
and reached through dependency injection; there are no module-level singletons, so several
apps (e.g. in tests) can live in one process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from litestar import Litestar
from litestar.di import Provide

from server.api.chat import chat_completions
from server.api.erasure import erase_session, erase_tenant
from server.api.errors import exception_handlers
from server.api.info import cache_stats, health, list_models, retrieve_model
from server.api.metrics import prometheus_metrics
from server.api.state import ServerState, attach, detach, provide_server, provide_tenant
from server.config import ServerConfig
from server.engine.protocol import Engine
from server.engine.settings import EngineSettings
from server.engine.worker import EngineWorker
from server.metrics import ServerMetrics
from tenancy.registry import TenantRegistry
from tenancy.secret import load_or_create_secret

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineSettings], Engine]

_NO_KEYS_WARNING = """
###########################################################################
# NO KEYS FILE (--keys): AUTHENTICATION IS OFF.
# Every request is served as the single tenant 'default', which is admin:
# anyone who can reach %s:%s can use this server and read its cache stats.
###########################################################################"""


def _registry(config: ServerConfig, secret: bytes) -> TenantRegistry:
    if config.keys_file is not None:
        registry = TenantRegistry.from_keys_file(config.keys_file, secret)
        log.info("loaded %d tenants from %s", len(registry.all()), config.keys_file)
        return registry
    log.warning(_NO_KEYS_WARNING, config.host, config.port)
    return TenantRegistry.single_default(secret)


async def _sweep_forever(worker: EngineWorker, interval_s: float) -> None:
    """The retention sweeper: every ``interval_s`` seconds, on the engine thread between requests,
    drop cached state past its tenant's retention (reads already treat it as a miss)."""
    while True:
        await asyncio.sleep(interval_s)
        if not worker.alive:
            return
        try:
            report = await worker.call(lambda engine: engine.sweep())
        except Exception:
            # Reads still refuse expired state; keep sweeping, and let the failure be seen.
            log.exception("retention sweep failed")
            continue
        log.debug("retention sweep: %s", report)


def create_app(config: ServerConfig, *, engine_factory: EngineFactory | None = None) -> Litestar:
    """Build the app; the model loads when the app starts (its lifespan), not here.

    Args:
        config: server configuration.
        engine_factory: builds the engine from ``config.engine`` on the engine thread;
            defaults to ``server.engine.runner.build_engine``.
    """
    if engine_factory is None:
        from server.engine.runner import build_engine

        engine_factory = build_engine
    factory = engine_factory
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        secret = await asyncio.to_thread(load_or_create_secret, config.cache_dir)
        registry = _registry(config, secret)
        worker = EngineWorker(lambda: factory(config.engine))
        engine = await worker.start()
        # Every tenant's quotas and retention, also of tenants that send nothing this run but
        # have state on disk.
        await worker.call(lambda built: built.configure_tenants(registry.all()))
        sweeper = asyncio.create_task(_sweep_forever(worker, config.ttl_sweep_interval_s))
        metrics.engine.bind(engine)
        names = {engine.model_id}
        if config.model_name:
            names.add(config.model_name)
        attach(app.state, ServerState(
            config=config,
            registry=registry,
            worker=worker,
            served_model=config.model_name or engine.model_id,
            model_names=frozenset(names),
            context_length=engine.context_length,
            created=int(time.time()),
        ))
        log.info("serving %s (context %d tokens) on http://%s:%s", config.model_name or engine.model_id,
                 engine.context_length, config.host, config.port)
        try:
            yield
        finally:
            sweeper.cancel()
            await asyncio.wait([sweeper])
            detach(app.state)
            metrics.engine.unbind()
            await asyncio.to_thread(worker.stop)

    return Litestar(
        route_handlers=[chat_completions, list_models, retrieve_model, health, cache_stats,
                        prometheus_metrics, erase_session, erase_tenant],
        dependencies={"server": Provide(provide_server, sync_to_thread=False),
                      "tenant": Provide(provide_tenant, sync_to_thread=False),
                      "metrics": Provide(lambda: metrics, use_cache=True, sync_to_thread=False)},
        middleware=[metrics.middleware],
        exception_handlers=exception_handlers(),
        lifespan=[lifespan],
        request_max_body_size=config.max_body_bytes,
        openapi_config=None,
        # Logging is configured by the CLI (or the embedding program), not by the app.
        logging_config=None,
    )
