"""The server secret: 32 random bytes in ``<cache_dir>/server_secret``, created once.

Tenant salts are derived from it, so it must outlive restarts for the disk caches to stay
reachable, and it must stay private: whoever reads it can compute every tenant's salt.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

SECRET_FILE_NAME = "server_secret"
SECRET_BYTES = 32


class SecretFileError(RuntimeError):
    """The secret file exists but cannot be used (permissions, type or length)."""


def load_or_create_secret(cache_dir: Path) -> bytes:
    """Return the server secret, creating it on first use.

    Creation is race-free: the bytes are written and fsynced to a private temporary file (opened
    ``O_CREAT | O_EXCL`` with mode 0600), which is then hard-linked to its final name. ``link``
    fails if the name exists, so of two processes starting at once exactly one wins and the other
    reads the winner's complete file; nobody ever sees a half-written secret.

    Args:
        cache_dir: Cache root; created (mode 0700) if missing.

    Returns:
        The 32-byte secret.

    Raises:
        SecretFileError: The existing file is not a regular file, is accessible by group or
            others, or does not hold exactly 32 bytes.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = cache_dir / SECRET_FILE_NAME
    if not os.path.lexists(path):
        _create(path)
    return _read(path)


def read_secret(cache_dir: Path) -> bytes:
    """The server secret of an existing cache directory, never creating one (offline tools).

    Raises:
        FileNotFoundError: The directory has no secret (it was never used by a server).
        SecretFileError: As ``load_or_create_secret``.
    """
    path = Path(cache_dir) / SECRET_FILE_NAME
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} does not exist: {cache_dir} is not a vlmcache cache directory")
    return _read(path)


def _create(path: Path) -> None:
    tmp = path.with_name(f".{SECRET_FILE_NAME}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            # The umask can only remove bits from 0600; make sure the owner can still read it.
            os.fchmod(fd, 0o600)
            data = secrets.token_bytes(SECRET_BYTES)
            written = os.write(fd, data)
            assert written == SECRET_BYTES, f"short write of the secret: {written} bytes"
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # Another process created it first; _read() uses theirs.
        else:
            _fsync_dir(path.parent)
    finally:
        os.unlink(tmp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SecretFileError(f"{path} is a symbolic link; use a regular file") from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretFileError(f"{path} is not a regular file")
        loose = stat.S_IMODE(st.st_mode) & 0o077
        if loose:
            raise SecretFileError(
                f"{path} has permissions {stat.S_IMODE(st.st_mode):04o}: group/other must have "
                f"no access (run: chmod 600 {path})"
            )
        if st.st_size != SECRET_BYTES:
            raise SecretFileError(
                f"{path} holds {st.st_size} bytes, expected exactly {SECRET_BYTES}; restore the "
                "original file (a new secret makes every cached entry unreachable)"
            )
        data = os.read(fd, SECRET_BYTES)
    finally:
        os.close(fd)
    assert len(data) == SECRET_BYTES, f"short read of {path}: {len(data)} bytes"
    return data
