"""The ``vlmcache`` command line.

Environment variables are read here and in ``server.config`` only; everything below receives
explicit arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from server import blas

log = logging.getLogger("vlmcache")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from server.config import add_serve_arguments

    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from server.config import ServerConfig
    from server.main import serve

    config = ServerConfig.from_args(args, os.environ)
    serve(config)
    return 0


def _add_fixtures(sub: argparse._SubParsersAction) -> None:
    from fixtures.build import FAMILIES, PRESETS

    p = sub.add_parser("fixtures", help="build the tiny offline fixture models")
    fsub = p.add_subparsers(dest="fixtures_cmd", required=True)
    b = fsub.add_parser("build", help="build fixture models (all families by default)")
    b.add_argument("--family", choices=sorted(FAMILIES), action="append",
                   help="family to build (repeatable; default: all)")
    b.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    b.add_argument("--out", default=None,
                   help="output directory (default: the per-user fixture cache)")
    b.set_defaults(func=_cmd_fixtures_build)


def _cmd_fixtures_build(args: argparse.Namespace) -> int:
    from fixtures.build import FAMILIES, build_fixture, ensure_fixture

    for family in args.family or sorted(FAMILIES):
        if args.out:
            path = build_fixture(family, args.preset, os.path.join(args.out, f"{family}-{args.preset}"))
        else:
            path = ensure_fixture(family, args.preset)
        print(path)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from server.bench.command import add_bench_arguments

    p = sub.add_parser("bench", help="replay image conversations against OpenAI-compatible "
                       "servers: TTFT per turn, cached tokens, plots")
    add_bench_arguments(p)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from server.bench.command import run_command

    return run_command(args, sys.argv[1:])


def _add_cache(sub: argparse._SubParsersAction) -> None:
    from pathlib import Path

    from server.config import DEFAULT_CACHE_DIR
    from server.offline.commands import add_cache_arguments

    default = Path(os.environ.get("VLMCACHE_CACHE_DIR") or DEFAULT_CACHE_DIR).expanduser()
    add_cache_arguments(sub, default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmcache", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=os.environ.get("VLMCACHE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_fixtures(sub)
    _add_bench(sub)
    _add_cache(sub)
    return parser


# Commands that run models for a long time and so are worth a re-exec with OpenBLAS.
_BLAS_COMMANDS = {"serve", "bench"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _BLAS_COMMANDS:
        blas.maybe_reexec_with_openblas(argv, os.environ)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command in _BLAS_COMMANDS:
        log.info(blas.preload_status(os.environ))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
