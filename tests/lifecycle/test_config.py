"""The retention sweeper's interval: flag, environment variable, default, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import build_parser
from server.config import ServerConfig


def config(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(["serve", *argv])
    return ServerConfig.from_args(args, env or {}, resolve_fixture=lambda f, p: Path(f"/fixtures/{f}-{p}"))


def test_ttl_sweep_interval_from_flag_environment_or_default() -> None:
    assert config([]).ttl_sweep_interval_s == 60.0
    assert config([], {"VLMCACHE_TTL_SWEEP_INTERVAL": "5"}).ttl_sweep_interval_s == 5.0
    assert config(["--ttl-sweep-interval", "0.5"], {"VLMCACHE_TTL_SWEEP_INTERVAL": "5"}).ttl_sweep_interval_s == 0.5
    with pytest.raises(ValueError, match="ttl_sweep_interval_s must be > 0"):
        config(["--ttl-sweep-interval", "0"])
