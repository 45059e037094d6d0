"""Live servers for the server tests: the real app, the real engine on the tiny qwen2_vl
fixture, uvicorn on 127.0.0.1 in a background thread, one server per test module."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from fixtures.build import ensure_fixture
from server.config import ServerConfig
from server.engine.settings import EngineSettings
from server.main import uvicorn_server

STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LiveServer:
    """A running server: its base URL, its config and the app (to reach its state)."""

    base_url: str
    config: ServerConfig
    model: str

    def client(self, api_key: str = "unused", **kwargs: Any) -> OpenAI:
        """The real ``openai`` client pointed at this server (no retries: errors must show)."""
        return OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                      timeout=60.0, **kwargs)

    def http(self, timeout: float = 60.0, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=timeout, **kwargs)


def make_config(model_path: Path, cache_dir: Path, **overrides: Any) -> ServerConfig:
    """A config for tests: tiny model, private cache dir, small limits where asked."""
    engine_overrides = {k: overrides.pop(k) for k in list(overrides)
                        if k in {f.name for f in dataclasses.fields(EngineSettings)}}
    engine = EngineSettings(model_path=model_path, cache_dir=cache_dir, **engine_overrides)
    return ServerConfig(engine=engine, host="127.0.0.1", port=0, log_level="warning", **overrides)


@contextmanager
def running_server(config: ServerConfig) -> Iterator[LiveServer]:
    """Start the app under uvicorn on a free port in a thread; stop it (and the engine) after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, 0))
    port = sock.getsockname()[1]
    server = uvicorn_server(dataclasses.replace(config, port=port))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server exited during startup (see the log above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start within {STARTUP_TIMEOUT_S} s")
        time.sleep(0.02)
    base_url = f"http://127.0.0.1:{port}"
    model = httpx.get(base_url + "/health", timeout=10).json()["model"]
    try:
        yield LiveServer(base_url=base_url, config=config, model=model)
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return ensure_fixture("qwen2_vl", "tiny")


@pytest.fixture(scope="module")
def live_server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server without a keys file (single ``default`` tenant), default limits."""
    config = make_config(tiny_model_path, tmp_path_factory.mktemp("state"))
    with running_server(config) as server:
        yield server
