"""Server configuration: command-line flags and ``VLMCACHE_*`` environment variables.

This is the only module besides ``server/cli.py`` that reads the environment. Precedence for
every setting: command-line flag, then environment variable, then default. Everything below
this layer receives a frozen ``ServerConfig``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.engine.settings import EngineSettings

DEFAULT_FIXTURE = "qwen2_vl"
DEFAULT_FIXTURE_PRESET = "tiny"
DEFAULT_CACHE_DIR = Path("~/.cache/vlmcache/state")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_PIXELS_RE = re.compile(r"^\s*(\d+)\s*[*xX]\s*(\d+)\s*$")


def parse_byte_size(text: str) -> int:
    """Parse a byte size such as ``"512MB"``, ``"2GiB"``, ``"1.5G"`` or ``"1048576"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers
    of 1024, as their names say.

    Raises:
        ValueError: the text is not a non-negative size with a known unit.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"not a byte size: {text!r} (examples: 512MB, 2GiB, 1048576)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}; known: {', '.join(u for u in _UNITS if u)}")
    return int(float(number) * factor)


def parse_pixel_count(text: str) -> int:
    """Parse a pixel count given as ``"16777216"`` or as ``"4096*4096"`` / ``"4096x4096"``.

    Raises:
        ValueError: the text is neither form.
    """
    match = _PIXELS_RE.match(text)
    if match is not None:
        return int(match.group(1)) * int(match.group(2))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"not a pixel count: {text!r} (examples: 16777216, 4096*4096)") from None


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything the server needs, resolved from flags, environment and defaults.

    Attributes:
        engine: settings handed to the engine factory (model path, cache dir, block size, ...).
        host: interface to bind.
        port: TCP port to bind.
        keys_file: TOML file mapping API keys to tenants; None = one ``default`` tenant, no auth.
        model_name: name served in /v1/models and accepted in requests; None = the engine's.
        max_images: most images accepted in one request (all messages together).
        max_image_pixels: most pixels (width * height) of one decoded image.
        max_image_bytes: most encoded bytes of one image (after base64 decoding or download).
        max_body_bytes: most bytes of one request body; larger bodies get 413 before parsing.
        allow_http_images: fetch ``http(s)://`` image URLs (off by default: server-side
            request forgery).
        http_image_timeout_s: total time allowed to download one http image.
        ttl_sweep_interval_s: seconds between retention sweeps (state past a tenant's
            ``retention_seconds`` is dropped from every tier; reads never serve it meanwhile).
        log_level: logging level name for the server process.
    """

    engine: EngineSettings
    host: str = "127.0.0.1"
    port: int = 8000
    keys_file: Path | None = None
    model_name: str | None = None
    max_images: int = 8
    max_image_pixels: int = 4096 * 4096
    max_image_bytes: int = 20 * 2**20
    max_body_bytes: int = 32 * 2**20
    allow_http_images: bool = False
    http_image_timeout_s: float = 10.0
    ttl_sweep_interval_s: float = 60.0
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        for name in ("max_images", "max_image_pixels", "max_image_bytes", "max_body_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.http_image_timeout_s <= 0:
            raise ValueError(f"http_image_timeout_s must be > 0, got {self.http_image_timeout_s}")
        if not self.ttl_sweep_interval_s > 0:
            raise ValueError(f"ttl_sweep_interval_s must be > 0, got {self.ttl_sweep_interval_s}")

    @property
    def cache_dir(self) -> Path:
        """Root of the on-disk state (server secret, SSD tier)."""
        return self.engine.cache_dir

    @classmethod
    def from_args(
        cls,
        args: argparse.Namespace,
        environ: Mapping[str, str],
        *,
        resolve_fixture: Callable[[str, str], Path] | None = None,
    ) -> ServerConfig:
        """Resolve the configuration from parsed ``serve`` arguments and the environment.

        Args:
            args: namespace from a parser prepared with ``add_serve_arguments``.
            environ: the process environment (only ``VLMCACHE_*`` keys are read).
            resolve_fixture: ``(family, preset) -> model directory``; defaults to
                ``fixtures.build.ensure_fixture`` (builds the fixture once, then reuses it).

        Raises:
            ValueError: a value is malformed, or both a model path and a fixture are given.
        """
        values = _Resolver(args, environ)
        # A model source given on the command line replaces any source from the environment.
        if getattr(args, "model", None) is not None or getattr(args, "fixture", None) is not None:
            model, fixture = getattr(args, "model", None), getattr(args, "fixture", None)
        else:
            model, fixture = values.get("model", None), values.get("fixture", None)
        if model is not None and fixture is not None:
            raise ValueError(f"give either --model ({model}) or --fixture ({fixture}), not both")
        default_name = None
        if model is not None:
            model_path = Path(model).expanduser()
        else:
            if resolve_fixture is None:
                from fixtures.build import ensure_fixture

                resolve_fixture = ensure_fixture
            family = fixture or DEFAULT_FIXTURE
            preset = values.get("fixture_preset", DEFAULT_FIXTURE_PRESET)
            model_path = Path(resolve_fixture(family, preset))
            # A stable name for clients: the directory name carries a version digest.
            default_name = f"{family}-{preset}"

        ram_budget = values.get("ram_budget", None, parse_byte_size)
        vision_budget = values.get("vision_budget", None, parse_byte_size)
        engine = EngineSettings(
            model_path=model_path,
            cache_dir=Path(values.get("cache_dir", str(DEFAULT_CACHE_DIR))).expanduser(),
            block_size=values.get("block_size", 64, int),
            prefill_chunk=values.get("prefill_chunk", 512, int),
            ram_budget_bytes=ram_budget,
            vision_budget_bytes=vision_budget,
            max_tokens_default=values.get("default_max_tokens", 256, int),
            hit_rate_warn_threshold=values.get("hit_rate_warn_threshold", 0.2, float),
            hit_rate_window=values.get("hit_rate_window", 50, int),
            ssd_enabled=not values.get("no_ssd", False, _parse_bool),
            ssd_budget_bytes=values.get("ssd_budget", 10 * 2**30, parse_byte_size),
            ssd_queue_size=values.get("ssd_queue", 64, int),
        )
        keys = values.get("keys", None)
        return cls(
            engine=engine,
            host=values.get("host", "127.0.0.1"),
            port=values.get("port", 8000, int),
            keys_file=Path(keys).expanduser() if keys else None,
            model_name=values.get("model_name", default_name),
            max_images=values.get("max_images", 8, int),
            max_image_pixels=values.get("max_image_pixels", 4096 * 4096, parse_pixel_count),
            max_image_bytes=values.get("max_image_bytes", 20 * 2**20, parse_byte_size),
            max_body_bytes=values.get("max_body_bytes", 32 * 2**20, parse_byte_size),
            allow_http_images=values.get("allow_http_images", False, _parse_bool),
            http_image_timeout_s=values.get("http_image_timeout", 10.0, float),
            ttl_sweep_interval_s=values.get("ttl_sweep_interval", 60.0, float),
            log_level=str(getattr(args, "log_level", None) or "info").lower(),
        )


class _Resolver:
    """Looks a setting up as flag, then ``VLMCACHE_<NAME>``, then default."""

    def __init__(self, args: argparse.Namespace, environ: Mapping[str, str]) -> None:
        self._args = args
        self._environ = environ

    def get(self, name: str, default: Any, convert: Callable[[str], Any] = str) -> Any:
        value = getattr(self._args, name, None)
        if value is None:
            env_name = "VLMCACHE_" + name.upper()
            raw = self._environ.get(env_name)
            if raw is None or raw == "":
                return default
            try:
                return convert(raw)
            except ValueError as exc:
                raise ValueError(f"{env_name}: {exc}") from None
        if isinstance(value, str) and convert is not str:
            try:
                return convert(value)
            except ValueError as exc:
                raise ValueError(f"--{name.replace('_', '-')}: {exc}") from None
        return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``vlmcache serve`` flags to ``parser``.

    Every flag defaults to None so that ``ServerConfig.from_args`` can tell a flag that was not
    given (fall back to ``VLMCACHE_<NAME>``, then the default) from one that was.
    """
    parser.epilog = ("Every flag can also come from the environment as VLMCACHE_<FLAG> (upper case, "
                     "dashes as underscores, e.g. VLMCACHE_RAM_BUDGET=2GiB); a flag wins over "
                     "its variable.")
    model = parser.add_argument_group("model")
    source = model.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="PATH", help="directory of an mlx-vlm model")
    source.add_argument("--fixture", metavar="NAME",
                        help=f"serve a tiny built-in fixture model (default {DEFAULT_FIXTURE})")
    model.add_argument("--fixture-preset", metavar="PRESET",
                       help=f"fixture size preset (default {DEFAULT_FIXTURE_PRESET})")
    model.add_argument("--model-name", metavar="NAME",
                       help="model name served in /v1/models and accepted in requests "
                            "(default: the engine's model id)")
    model.add_argument("--default-max-tokens", type=int, metavar="N",
                       help="completion length when a request names none (default 256)")

    net = parser.add_argument_group("network")
    net.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    net.add_argument("--port", type=int, help="TCP port (default 8000)")
    net.add_argument("--keys", metavar="FILE",
                     help="TOML file of API keys -> tenants; without it one 'default' tenant "
                          "and no authentication")

    cache = parser.add_argument_group("cache")
    cache.add_argument("--cache-dir", metavar="DIR",
                       help=f"state directory: server secret, SSD tier (default {DEFAULT_CACHE_DIR})")
    cache.add_argument("--ram-budget", metavar="SIZE",
                       help="KV RAM tier budget, e.g. 512MB or 2GiB (default 20%% of available RAM)")
    cache.add_argument("--vision-budget", metavar="SIZE",
                       help="vision-feature cache budget (default 1/8 of the RAM budget)")
    cache.add_argument("--no-ssd", action="store_const", const=True,
                       help="RAM only: no SSD tier (evicted blocks are dropped, nothing on disk)")
    cache.add_argument("--ssd-budget", metavar="SIZE",
                       help="SSD tier capacity; least recently used files go first (default 10GiB)")
    cache.add_argument("--ssd-queue", type=int, metavar="BLOCKS",
                       help="pending SSD writes before spills are dropped (counted) rather than "
                            "block a request (default 64)")
    cache.add_argument("--ttl-sweep-interval", type=float, metavar="SECONDS",
                       help="seconds between sweeps that drop cached state past its tenant's "
                            "retention_seconds from every tier (default 60; expired state is "
                            "never served meanwhile)")
    cache.add_argument("--block-size", type=int, metavar="TOKENS",
                       help="tokens per KV block (default 64)")
    cache.add_argument("--prefill-chunk", type=int, metavar="TOKENS",
                       help="tokens per prefill step (default 512)")
    cache.add_argument("--hit-rate-warn-threshold", type=float, metavar="RATE",
                       help="log one warning naming the dominant miss reason when the rolling "
                            "prefix-cache block hit rate falls below RATE (default 0.2; 0 = off)")
    cache.add_argument("--hit-rate-window", type=int, metavar="REQUESTS",
                       help="requests in that rolling window (default 50)")

    limits = parser.add_argument_group("request limits")
    limits.add_argument("--max-images", type=int, metavar="N",
                        help="most images per request (default 8)")
    limits.add_argument("--max-image-pixels", metavar="PIXELS",
                        help="most pixels of one image, e.g. 4096*4096 (the default)")
    limits.add_argument("--max-image-bytes", metavar="SIZE",
                        help="most encoded bytes of one image (default 20MiB)")
    limits.add_argument("--max-body-bytes", metavar="SIZE",
                        help="most bytes of one request body (default 32MiB)")
    limits.add_argument("--allow-http-images", action="store_const", const=True,
                        help="fetch http(s) image URLs (off by default: server-side request forgery)")
    limits.add_argument("--http-image-timeout", type=float, metavar="SECONDS",
                        help="total time allowed to download one http image (default 10)")
