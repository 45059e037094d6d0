"""The hit-rate warning settings: flags, environment, defaults, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.cli import build_parser
from server.config import ServerConfig


def _config(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(["serve", *argv])
    return ServerConfig.from_args(args, env or {}, resolve_fixture=lambda f, p: Path(f"/{f}-{p}"))


def test_hit_rate_warning_settings() -> None:
    default = _config([]).engine
    assert (default.hit_rate_warn_threshold, default.hit_rate_window) == (0.2, 50)
    flags = _config(["--hit-rate-warn-threshold", "0.5", "--hit-rate-window", "20"]).engine
    assert (flags.hit_rate_warn_threshold, flags.hit_rate_window) == (0.5, 20)
    env = _config([], {"VLMCACHE_HIT_RATE_WARN_THRESHOLD": "0",
                       "VLMCACHE_HIT_RATE_WINDOW": "7"}).engine
    assert (env.hit_rate_warn_threshold, env.hit_rate_window) == (0.0, 7)


@pytest.mark.parametrize(("argv", "message"), [
    (["--hit-rate-warn-threshold", "1.5"], "hit_rate_warn_threshold must be in"),
    (["--hit-rate-window", "0"], "hit_rate_window must be >= 1"),
])
def test_hit_rate_warning_settings_are_validated(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(argv)
