"""Running the app under uvicorn (``vlmcache serve``)."""

from __future__ import annotations

import socket

import uvicorn

from server.app import EngineFactory, create_app
from server.config import ServerConfig


def uvicorn_server(config: ServerConfig, *, engine_factory: EngineFactory | None = None) -> uvicorn.Server:
    """An unstarted uvicorn server for the app (tests drive it in a thread).

    Keep-alive connections and the lifespan are on; uvicorn's own access log is left to the
    ``uvicorn.access`` logger at the configured level.
    """
    app = create_app(config, engine_factory=engine_factory)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        lifespan="on",
        log_level=config.log_level,
        timeout_graceful_shutdown=10,
    )
    return uvicorn.Server(uv_config)


def serve(config: ServerConfig, *, sock: socket.socket | None = None) -> None:
    """Serve until interrupted (SIGINT/SIGTERM), then stop the engine thread cleanly.

    Args:
        config: server configuration.
        sock: an already bound listening socket (overrides host/port), e.g. for port 0.
    """
    server = uvicorn_server(config)
    server.run(sockets=[sock] if sock is not None else None)
