"""Use Debian's OpenBLAS under mlx's CPU backend.

The ``mlx[cpu]`` wheel bundles a reference BLAS (~3-5 GFLOPS fp32). Debian's OpenBLAS preloaded
with ``LD_PRELOAD`` runs the same matmuls at 200+ GFLOPS; a 512-token prefill of a 111M model
went from 61 s to 3.2 s. ``LD_PRELOAD`` only works when set before the process starts, so the
long-running commands (``serve``, ``bench``) re-execute themselves once with it set.

``python -m server.blas`` prints the library path (exit 0) or nothing (exit 1); the test
script uses it to preload the same library.
"""

from __future__ import annotations

import glob
import logging
import os
import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

# Marks the re-executed child so it never loops.
_REEXEC_MARK = "VLMCACHE_BLAS_REEXEC"
_DISABLE_SWITCH = "VLMCACHE_NO_OPENBLAS"
_CANDIDATE_GLOBS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/openblas-openmp/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
)
INSTALL_HINT = "apt-get install libopenblas0-pthread"


def find_openblas(machine: str | None = None) -> Path | None:
    """Return the path of Debian's OpenBLAS for this architecture, or None.

    Args:
        machine: ``platform.machine()`` value to match (default: this machine).
    """
    arch = machine or platform.machine()
    for pattern in _CANDIDATE_GLOBS:
        for hit in sorted(glob.glob(pattern)):
            if arch in hit or "*" not in pattern:
                return Path(hit)
    return None


def uses_cpu_backend() -> bool:
    """True where mlx runs on its CPU backend (Linux without CUDA)."""
    return sys.platform.startswith("linux")


def preload_status(env: Mapping[str, str]) -> str:
    """Describe which BLAS this process uses, for the startup log."""
    if not uses_cpu_backend():
        return "BLAS: platform default (mlx Metal/Accelerate)"
    preload = env.get("LD_PRELOAD", "")
    if "openblas" in preload:
        return f"BLAS: OpenBLAS preloaded ({preload})"
    if env.get(_DISABLE_SWITCH):
        return f"BLAS: mlx reference BLAS ({_DISABLE_SWITCH} set)"
    return (
        "BLAS: mlx reference BLAS (slow, ~50x below OpenBLAS); install Debian's OpenBLAS "
        f"for fast CPU inference: {INSTALL_HINT}"
    )


def maybe_reexec_with_openblas(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Re-execute this process with OpenBLAS preloaded when that helps; else return.

    Does nothing off Linux, when disabled by ``VLMCACHE_NO_OPENBLAS=1``, when OpenBLAS is
    already preloaded or absent, or in the re-executed child itself.

    Args:
        argv: arguments after the program name (``sys.argv[1:]``).
        env: the current environment.
    """
    if not uses_cpu_backend() or env.get(_DISABLE_SWITCH) or env.get(_REEXEC_MARK):
        return
    if "openblas" in env.get("LD_PRELOAD", ""):
        return
    lib = find_openblas()
    if lib is None:
        return
    child_env = dict(env)
    child_env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    child_env[_REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "server.cli", *argv], child_env)


def main() -> int:
    lib = find_openblas()
    if lib is None:
        return 1
    print(lib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
