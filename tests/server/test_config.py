"""ServerConfig from flags, environment and defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from server.cli import build_parser
from server.config import ServerConfig, parse_byte_size, parse_pixel_count


def _fixture_path(family: str, preset: str) -> Path:
    return Path(f"/fixtures/{family}-{preset}")


def _config(argv: list[str], env: dict[str, str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(["serve", *argv])
    return ServerConfig.from_args(args, env or {}, resolve_fixture=_fixture_path)


@pytest.mark.parametrize(("text", "value"), [
    ("1048576", 1048576), ("512MB", 512_000_000), ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30),
    ("1.5G", 1_500_000_000), ("32 mib", 32 * 2**20), ("10kB", 10_000), ("3KiB", 3072),
])
def test_parse_byte_size(text: str, value: int) -> None:
    assert parse_byte_size(text) == value


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-5MB", "1e3"])
def test_parse_byte_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_byte_size(text)


@pytest.mark.parametrize(("text", "value"), [("4096*4096", 16_777_216), ("640x480", 307_200),
                                             ("1000", 1000)])
def test_parse_pixel_count(text: str, value: int) -> None:
    assert parse_pixel_count(text) == value


def test_defaults() -> None:
    config = _config([])
    assert config.engine.model_path == Path("/fixtures/qwen2_vl-tiny")
    assert config.engine.cache_dir == Path("~/.cache/vlmcache/state").expanduser()
    assert (config.host, config.port, config.keys_file) == ("127.0.0.1", 8000, None)
    assert (config.engine.block_size, config.engine.prefill_chunk) == (64, 512)
    assert config.engine.ram_budget_bytes is None
    assert (config.max_images, config.max_image_pixels) == (8, 4096 * 4096)
    assert config.max_body_bytes == 32 * 2**20
    assert config.allow_http_images is False
    assert config.model_name == "qwen2_vl-tiny"  # stable name for a fixture


def test_flags() -> None:
    config = _config(["--model", "/models/m", "--host", "0.0.0.0", "--port", "9001",
                      "--keys", "/etc/keys.toml", "--cache-dir", "/var/state",
                      "--ram-budget", "512MB", "--vision-budget", "1GiB", "--block-size", "32",
                      "--prefill-chunk", "256", "--max-images", "3",
                      "--max-image-pixels", "1024*1024", "--max-body-bytes", "4MiB",
                      "--allow-http-images", "--model-name", "tiny", "--default-max-tokens", "16"])
    assert config.engine.model_path == Path("/models/m")
    assert (config.host, config.port, config.keys_file) == ("0.0.0.0", 9001, Path("/etc/keys.toml"))
    assert config.engine.cache_dir == Path("/var/state")
    assert config.engine.ram_budget_bytes == 512_000_000
    assert config.engine.vision_budget_bytes == 2**30
    assert (config.engine.block_size, config.engine.prefill_chunk) == (32, 256)
    assert (config.max_images, config.max_image_pixels, config.max_body_bytes) == (3, 2**20, 4 * 2**20)
    assert config.allow_http_images is True
    assert config.model_name == "tiny"
    assert config.engine.max_tokens_default == 16


def test_environment_fills_in_and_flags_win() -> None:
    env = {"VLMCACHE_PORT": "7000", "VLMCACHE_RAM_BUDGET": "1GiB", "VLMCACHE_FIXTURE": "gemma3",
           "VLMCACHE_ALLOW_HTTP_IMAGES": "yes", "VLMCACHE_HOST": "10.0.0.1", "OTHER_PORT": "1"}
    config = _config(["--host", "127.0.0.2"], env)
    assert config.port == 7000
    assert config.host == "127.0.0.2"
    assert config.engine.ram_budget_bytes == 2**30
    assert config.engine.model_path == Path("/fixtures/gemma3-tiny")
    assert config.allow_http_images is True


def test_model_flag_overrides_fixture_from_environment() -> None:
    config = _config(["--model", "/models/x"], {"VLMCACHE_FIXTURE": "gemma3"})
    assert config.engine.model_path == Path("/models/x")


def test_model_and_fixture_from_environment_conflict() -> None:
    with pytest.raises(ValueError, match="not both"):
        _config([], {"VLMCACHE_FIXTURE": "gemma3", "VLMCACHE_MODEL": "/m"})


def test_model_and_fixture_flags_are_exclusive() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "/m", "--fixture", "gemma3"])


def test_bad_values_name_their_source() -> None:
    with pytest.raises(ValueError, match="--ram-budget"):
        _config(["--ram-budget", "lots"])
    with pytest.raises(ValueError, match="VLMCACHE_MAX_BODY_BYTES"):
        _config([], {"VLMCACHE_MAX_BODY_BYTES": "big"})
    with pytest.raises(ValueError, match="block_size"):
        _config(["--block-size", "0"])
    with pytest.raises(ValueError, match="max_images"):
        _config(["--max-images", "0"])


def test_from_args_without_cli_parser() -> None:
    args = argparse.Namespace(model="/m", port=None)
    config = ServerConfig.from_args(args, {"VLMCACHE_PORT": "1234"})
    assert (config.engine.model_path, config.port) == (Path("/m"), 1234)


def test_ssd_flags_and_env() -> None:
    from server.config import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    fixture = lambda family, preset: Path(f"/fixtures/{family}-{preset}")  # noqa: E731
    on = ServerConfig.from_args(parser.parse_args([]), {}, resolve_fixture=fixture)
    assert (on.engine.ssd_enabled, on.engine.ssd_budget_bytes, on.engine.ssd_queue_size) == (
        True, 10 * 2**30, 64)
    off = ServerConfig.from_args(
        parser.parse_args(["--no-ssd", "--ssd-budget", "2GiB", "--ssd-queue", "8"]), {},
        resolve_fixture=fixture)
    assert (off.engine.ssd_enabled, off.engine.ssd_budget_bytes, off.engine.ssd_queue_size) == (
        False, 2 * 2**30, 8)
    env = ServerConfig.from_args(parser.parse_args([]), {"VLMCACHE_NO_SSD": "1"},
                                 resolve_fixture=fixture)
    assert env.engine.ssd_enabled is False
