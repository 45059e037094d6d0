"""File-level helpers of the SSD tier: whole-file reads into reusable buffers, the directory
lock that makes one process the owner of a tier, and pruning of emptied directories."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kv_cache.serialization import CorruptFileError, ParsedFile, parse_file
from kv_cache.tiers.ssd_index import RecordKind


class SsdTierBusyError(RuntimeError):
    """Another open tier (this process or another) holds the cache directory for this model."""


@dataclass(frozen=True, slots=True)
class Fetched:
    """One file as a reader thread left it: parsed and verified, failed, or missing (both
    ``parsed`` and ``error`` None)."""

    kind: RecordKind
    key: bytes
    path: Path
    parsed: ParsedFile | None
    error: CorruptFileError | None
    size: int
    io_seconds: float


def fetch_file(
    path: Path, kind: RecordKind, key: bytes, buffers: list[bytearray] | None = None, slot: int = 0
) -> Fetched:
    """Read and checksum one record file, into ``buffers[slot]`` when given (grown if too
    small); failures come back as values (any thread)."""
    started = time.perf_counter()
    try:
        if buffers is None:
            data: bytearray | memoryview = read_file(path)
        else:
            data, buffers[slot] = read_file_into(path, buffers[slot])
    except FileNotFoundError:
        return Fetched(kind, key, path, None, None, 0, 0.0)
    io_seconds = time.perf_counter() - started
    try:
        return Fetched(kind, key, path, parse_file(data), None, len(data), io_seconds)
    except CorruptFileError as exc:
        return Fetched(kind, key, path, None, exc, len(data), io_seconds)


def read_file(path: Path) -> bytearray:
    """A whole file in a new buffer (raises FileNotFoundError when it is gone)."""
    view, buffer = read_file_into(path, bytearray())
    return buffer if len(view) == len(buffer) else bytearray(view)


def read_file_into(path: Path, buffer: bytearray) -> tuple[memoryview, bytearray]:
    """Read a whole file into ``buffer``, or a new larger one if it does not fit.

    Returns:
        A view of the bytes read (shorter than the file if it shrank meanwhile) and the buffer
        holding them.

    Raises:
        FileNotFoundError: The file is gone.
    """
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if len(buffer) < size:
            buffer = bytearray(size)
        view = memoryview(buffer)
        done = 0
        while done < size:
            count = f.readinto(view[done:size])
            if not count:
                break
            done += count
    return view[:done], buffer


def lock_tier(path: Path) -> int:
    """Take the exclusive lock of a tier directory (``ssd/<fp16>/lock``); returns its fd.

    Raises:
        SsdTierBusyError: Another open tier (this process or another) holds it.
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SsdTierBusyError(f"the SSD tier at {path.parent} is open in another tier or process") from None
    return fd


def prune_empty_dirs(directory: Path, stop: Path) -> None:
    """Remove ``directory`` and its parents up to (not including) ``stop`` while they are empty.

    Erasure leaves a tenant's ``<hh>/<hh>`` directories empty; their names are key prefixes,
    which is all they would still say.
    """
    directory = Path(directory)
    stop = Path(stop)
    while directory != stop and stop in directory.parents:
        try:
            directory.rmdir()
        except FileNotFoundError:
            pass  # already gone: go on with the parent
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                return  # still in use: so are its parents
            raise
        directory = directory.parent
