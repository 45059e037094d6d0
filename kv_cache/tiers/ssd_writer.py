"""The SSD tier's background writer: a bounded queue, crash-safe file writes.

```
 engine thread                          writer thread
 submit(job) --put_nowait--> queue --> prepare (checksum, header)
   full: dropped, counted                 write temp file, fsync, rename, fsync directory
 pending[(kind, key)] = job               commit(job, size): index row, capacity
   (a queued record is served from here)  pending.pop
```

A request never waits for the disk: when the queue is full the record is dropped (the caller
counts it). A file appears under its final name only complete and fsynced, so a crash leaves
either the old state, a temp file (removed by reconcile), or a complete file whose index row
may be missing (adopted by reconcile).

I/O errors (disk full, EIO) fail one record: they are logged and reported to ``on_error``, the
writer goes on. Any other exception is a bug: the writer stops, and ``close`` re-raises it.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import sqlite3
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kv_cache.serialization import HostTensor, PreparedFile, prepare_file
from kv_cache.tiers.ssd_index import IndexRow, RecordKind

log = logging.getLogger(__name__)

TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class WriteJob:
    """One record to write.

    Attributes:
        path: Final file path.
        tensors: Host views of the record's arrays.
        metadata: Record metadata (the checksum is added when the file is prepared).
        row: The index row to insert once the file is in place (``size`` is filled in then).
        value: The in-memory record, served to readers while the job is queued.
    """

    path: Path
    tensors: tuple[HostTensor, ...]
    metadata: dict[str, Any]
    row: IndexRow
    value: Any

    @property
    def ident(self) -> tuple[RecordKind, bytes]:
        return self.row.kind, self.row.key


_STOP = object()


class SsdWriter:
    """Writes jobs on a daemon thread, in submission order.

    Args:
        capacity: Most jobs queued at once.
        commit: Called on the writer thread after a file is in place: ``(job, file size)``.
        on_error: Called on the writer thread when a job fails with an I/O error.
    """

    def __init__(
        self,
        capacity: int,
        commit: Callable[[WriteJob, int], None],
        on_error: Callable[[WriteJob, BaseException], None],
    ) -> None:
        if capacity < 1:
            raise ValueError(f"write queue capacity must be >= 1, got {capacity}")
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=capacity)
        self._commit = commit
        self._on_error = on_error
        self._lock = threading.Lock()
        self._pending: dict[tuple[RecordKind, bytes], WriteJob] = {}
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ssd-writer", daemon=True)
        self._thread.start()

    def submit(self, job: WriteJob, *, wait: bool = False) -> bool:
        """Queue a job; a job for a record already queued is not queued twice.

        Args:
            job: What to write.
            wait: Block while the queue is full (shutdown flush) instead of dropping.

        Returns:
            False when the job was dropped (queue full) or the writer has stopped.
        """
        if self._closed or self._failure is not None:
            return False
        with self._lock:
            if job.ident in self._pending:
                return True
            self._pending[job.ident] = job
        try:
            if wait:
                self._queue.put(job)
            else:
                self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                del self._pending[job.ident]
            return False
        return True

    def pending(self, kind: RecordKind, key: bytes) -> WriteJob | None:
        """The queued (not yet committed) job of a record, if any."""
        with self._lock:
            return self._pending.get((kind, key))

    def pending_jobs(self) -> list[WriteJob]:
        """A snapshot of the queued jobs."""
        with self._lock:
            return list(self._pending.values())

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._pending)

    def flush(self) -> None:
        """Wait until every queued job is written (or failed)."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, stop the thread, and re-raise a crash of the writer."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
        if self._failure is not None:
            raise RuntimeError("the SSD writer thread failed") from self._failure

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                if self._failure is None:
                    self._write(job)
            except BaseException as exc:  # a bug: stop writing, report at close()
                log.exception("SSD writer failed on %s", getattr(job, "path", job))
                self._failure = exc
            finally:
                if job is not _STOP:
                    with self._lock:
                        self._pending.pop(job.ident, None)
                self._queue.task_done()

    def _write(self, job: WriteJob) -> None:
        try:
            prepared = prepare_file(job.tensors, job.metadata)
            write_atomic(job.path, prepared)
            self._commit(job, prepared.size)
        except (OSError, sqlite3.Error) as exc:
            log.warning("SSD write of %s failed: %s", job.path, exc)
            self._on_error(job, exc)


def write_atomic(path: Path, prepared: PreparedFile) -> None:
    """Write a file so that it appears under ``path`` only complete and on disk.

    Temp file in the same directory (``O_EXCL``, mode 0600), every byte written, fsync, rename,
    fsync of the directory. Directories created on the way are fsynced into their parents.
    """
    _make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        try:
            _write_all(fd, prepared.chunks())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _write_all(fd: int, chunks: Sequence[memoryview]) -> None:
    for chunk in chunks:
        view = chunk
        while len(view):
            written = os.write(fd, view)
            view = view[written:]


def _make_dirs(directory: Path) -> None:
    missing = []
    probe = directory
    while not probe.exists():
        missing.append(probe)
        probe = probe.parent
    for new in reversed(missing):
        try:
            new.mkdir(mode=0o700)
        except FileExistsError:
            continue
        fsync_dir(new.parent)


def fsync_dir(directory: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
