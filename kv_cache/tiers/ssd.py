"""SSD tier: cache records (KV blocks, vision features) as checksummed files, indexed in SQLite.

```
 RAM eviction --spill(block)--> host views --SsdWriter queue--> file + index row
                                   full: dropped (counted)       (temp, fsync, rename, fsync dir)
 lookup  --find_blocks / children--> index rows (+ queued records): no disk read
 promote --load_block--> queued record, or file read -> parse -> checksum -> identity -> payload
                              any failure: file to quarantine/, row dropped, a miss
 startup: lock, reconcile (temp files, rows without files, files without rows), capacity
 capacity: total file bytes <= budget, least recently used files deleted first
```

Records of each kind are described by a ``RecordCodec`` (KV blocks: ``ssd_codecs``; vision
features: ``vision_cache.ssd``): it turns a verified file into its index row, for reconcile.

Threads: the engine thread calls everything public; the writer thread writes files, inserts
rows and enforces the capacity. Counters are guarded by one lock.

One process per (cache dir, model): an exclusive ``flock`` on ``ssd/<fp16>/lock`` is held while
the tier is open (a second opener gets ``SsdTierBusyError``); the kernel drops it when the
process dies, so a crashed server never blocks its successor.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kv_cache.block import Block
from kv_cache.hashing import BlockHash
from kv_cache.payload import BlockPayload
from kv_cache.serialization import (
    BlockMeta,
    CorruptFileError,
    HostTensor,
    ParsedFile,
    block_metadata,
    block_tensors,
    decode_block,
    parse_file,
)
from kv_cache.tiers.ssd_codecs import BlockCodec, RecordCodec, block_row, row_meta
from kv_cache.tiers.ssd_index import IndexRow, RecordKind, SsdIndex
from kv_cache.tiers.ssd_layout import SsdLayout, check_namespace
from kv_cache.tiers.ssd_reconcile import ReconcileReport, quarantine, reconcile
from kv_cache.tiers.ssd_stats import SsdStats
from kv_cache.tiers.ssd_writer import SsdWriter, WriteJob

log = logging.getLogger(__name__)

DEFAULT_SSD_BUDGET = 10 * 2**30
DEFAULT_QUEUE_SIZE = 64
# Files read at once by a promotion: enough requests in flight to keep an SSD busy.
READ_THREADS = 4
# Files read ahead of the one being decoded (each with its own reused buffer).
READ_AHEAD = 8

T = TypeVar("T")


class SsdTierBusyError(RuntimeError):
    """Another open tier (this process or another) holds the cache directory for this model."""


@dataclass(frozen=True, slots=True)
class _Fetched:
    """One file as a reader thread left it: parsed and verified, failed, or missing (both
    ``parsed`` and ``error`` None)."""

    kind: RecordKind
    key: bytes
    path: Path
    parsed: ParsedFile | None
    error: CorruptFileError | None
    size: int
    io_seconds: float


class SsdTier:
    """The SSD tier of one model under one cache directory.

    Args:
        cache_dir: The cache root (shared with the server secret, other models' trees).
        fingerprint: The model fingerprint: names the trees, checked in every file.
        families: Cache family name of each layer (checked in every block file).
        budget_bytes: Capacity in file bytes.
        queue_size: Most records waiting to be written.
        codecs: Codecs of record kinds other than KV blocks (e.g. vision features); files of
            a kind without a codec are left alone by reconcile.
        clock: Wall-clock nanoseconds for LRU stamps (they must survive restarts).

    Raises:
        SsdTierBusyError: The directory is in use for this model.
    """

    def __init__(
        self,
        cache_dir: Path,
        fingerprint: str,
        families: Sequence[str],
        *,
        budget_bytes: int = DEFAULT_SSD_BUDGET,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        codecs: Iterable[RecordCodec] = (),
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"SSD budget must be >= 0 bytes, got {budget_bytes}")
        self.layout = SsdLayout(Path(cache_dir), fingerprint)
        self._fingerprint = fingerprint
        self._families = tuple(families)
        self._budget = budget_bytes
        self._clock = clock
        self._codecs: dict[RecordKind, RecordCodec] = {RecordKind.KV: BlockCodec(fingerprint, families)}
        for codec in codecs:
            self._codecs[codec.kind] = codec
        self._lock_fd = _lock(self.layout.lock_path)
        # Plain numbers under a lock; ``stats()`` freezes them into an ``SsdStats``.
        self._counters: dict[str, float] = dataclasses.asdict(SsdStats(budget_bytes=budget_bytes))
        self._stats_lock = threading.Lock()
        self._closed = False
        try:
            self._index = SsdIndex(self.layout.index_path)
        except BaseException:
            os.close(self._lock_fd)
            raise
        # Started before reconcile (they idle until used) so that every attribute exists from
        # here on.
        self._writer = SsdWriter(queue_size, self._commit, self._write_failed)
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="ssd-read")
        # Start every reader now, not during the first restore after a restart.
        ready = threading.Barrier(READ_THREADS)
        for _ in range(READ_THREADS):
            self._readers.submit(ready.wait, 10.0)
        try:
            report = reconcile(self.layout, self._index, self._validate)
            files, size = self._index.totals()
            self._count(
                files=files,
                bytes=size,
                reconcile_temp_removed=report.temp_removed,
                reconcile_rows_dropped=report.rows_dropped,
                reconcile_adopted=report.adopted,
                reconcile_removed=report.removed,
            )
            self.reconcile_report: ReconcileReport = report
            self._enforce_capacity()
        except BaseException:
            self.close()
            raise

    # -- KV blocks -----------------------------------------------------------------------------

    def spill(self, block: Block, *, wait: bool = False) -> bool:
        """Queue an evicted block for writing (the prefix cache's ``on_evict``).

        A block already on disk or queued only has its recency and owners updated.

        Args:
            block: The block leaving RAM; its payload must be an evaluated ``BlockPayload``.
            wait: Block while the queue is full instead of dropping (shutdown flush).

        Returns:
            Whether the block is (or will be) on disk.
        """
        if block.namespace is None:
            self._count(unfiled=1)
            return False
        payload = block.payload
        if not isinstance(payload, BlockPayload):
            raise TypeError(f"block {block.block_hash.hex()} has no BlockPayload: {type(payload).__name__}")
        key = bytes(block.block_hash)
        if self._writer.pending(RecordKind.KV, key) is not None or self._index.use(
            RecordKind.KV, key, tuple(block.owners), self._clock()
        ):
            self._count(already_stored=1)
            return True
        meta = BlockMeta(
            block_hash=block.block_hash,
            parent=block.parent,
            tokens=block.tokens,
            extra=block.extra,
            partial=block.is_partial,
            checkpointed=payload.checkpoint is not None,
            namespace=check_namespace(block.namespace),
            owners=tuple(sorted(block.owners)),
            nbytes=payload.nbytes,
        )
        metadata = block_metadata(meta, payload, self._fingerprint, self._families)
        return self._submit(
            WriteJob(
                path=self.layout.path(RecordKind.KV, meta.namespace, key),
                tensors=block_tensors(payload),
                metadata=metadata,
                row=block_row(meta, 0, self._clock()),
                value=payload,
            ),
            wait,
        )

    def find_blocks(self, hashes: Sequence[BlockHash]) -> dict[BlockHash, BlockMeta]:
        """Identity of the blocks among ``hashes`` that are stored or queued (no disk read)."""
        found: dict[BlockHash, BlockMeta] = {}
        missing = []
        for digest in hashes:
            job = self._writer.pending(RecordKind.KV, bytes(digest))
            if job is not None:
                found[digest] = row_meta(job.row)
            else:
                missing.append(bytes(digest))
        if missing:
            for key, row in self._index.get(RecordKind.KV, missing).items():
                found[BlockHash(key)] = row_meta(row)
        return found

    def children(self, parent: BlockHash) -> list[BlockMeta]:
        """Stored or queued blocks whose parent is ``parent``, by hash."""
        rows = {row.key: row for row in self._index.children(bytes(parent))}
        for job in self._writer.pending_jobs():
            if job.row.kind is RecordKind.KV and job.row.parent == parent:
                rows[job.row.key] = job.row
        return [row_meta(rows[key]) for key in sorted(rows)]

    def load_blocks(self, metas: Sequence[BlockMeta]) -> Iterator[BlockPayload | None]:
        """The payloads of stored blocks, verified, in order (engine thread).

        Reader threads read and checksum up to ``READ_AHEAD`` files ahead of the one being
        decoded (parallel reads reach the disk's bandwidth where one at a time does not),
        each into one of ``READ_AHEAD`` buffers reused for the whole call: a fresh buffer
        per file costs more in page faults than the read itself. Decoding copies the tensors
        out, which frees the buffer for the next read. Stop iterating to cancel the rest.

        Yields:
            Per meta: the payload (from the write queue when still queued); None when the file
            is gone or failed verification (then quarantined and its row dropped).
        """
        buffers = [bytearray() for _ in range(READ_AHEAD)]
        fetches: dict[int, Future[_Fetched]] = {}

        def read_ahead(index: int) -> None:
            meta = metas[index]
            if self._writer.pending(RecordKind.KV, bytes(meta.block_hash)) is None:
                fetches[index] = self._readers.submit(
                    self._fetch, RecordKind.KV, meta.namespace, meta.block_hash, buffers, index % READ_AHEAD
                )

        for index in range(min(READ_AHEAD, len(metas))):
            read_ahead(index)
        used: list[bytes] = []
        try:
            for index, meta in enumerate(metas):
                started = time.perf_counter()
                fetch = fetches.pop(index, None)
                if fetch is None:
                    job = self._writer.pending(RecordKind.KV, bytes(meta.block_hash))
                    if job is not None:
                        self._count(queue_reads=1)
                        payload: BlockPayload | None = job.value
                    else:  # written since it was looked at: read it here (its buffer is free)
                        fetched = self._fetch(
                            RecordKind.KV, meta.namespace, meta.block_hash, buffers, index % READ_AHEAD
                        )
                        payload = self._finish(fetched, lambda parsed, m=meta: self._decode_block(parsed, m))
                else:
                    payload = self._finish(fetch.result(), lambda parsed, m=meta: self._decode_block(parsed, m))
                # This block's buffer is free again: start the read that reuses it.
                if index + READ_AHEAD < len(metas):
                    read_ahead(index + READ_AHEAD)
                self._count(read_seconds=time.perf_counter() - started)
                if payload is not None and fetch is not None:
                    used.append(bytes(meta.block_hash))
                yield payload
        finally:
            for fetch in fetches.values():
                fetch.cancel()
            # A read already running must not outlive the call with this call's buffers.
            wait(list(fetches.values()))
            if used:
                self._index.touch(RecordKind.KV, used, self._clock())

    def load_block(self, meta: BlockMeta) -> BlockPayload | None:
        """``load_blocks`` of one block."""
        return next(iter(self.load_blocks([meta])))

    def _decode_block(self, parsed: ParsedFile, meta: BlockMeta) -> BlockPayload:
        stored, payload = decode_block(parsed, self._fingerprint, self._families)
        if (stored.block_hash, stored.parent, stored.tokens, stored.extra, stored.partial) != (
            meta.block_hash, meta.parent, meta.tokens, meta.extra, meta.partial
        ):
            raise CorruptFileError(f"file of block {meta.block_hash.hex()} holds another block's identity")
        return payload

    def rows(self, kind: RecordKind) -> list[IndexRow]:
        """Every indexed record of a kind (a snapshot), by key."""
        return [row for row in self._index.rows() if row.kind is kind]

    def touch_blocks(self, hashes: Sequence[BlockHash]) -> None:
        """Mark stored blocks as just used (SSD LRU order)."""
        self._index.touch(RecordKind.KV, [bytes(h) for h in hashes], self._clock())

    # -- any record ----------------------------------------------------------------------------

    def store(
        self,
        kind: RecordKind,
        key: bytes,
        namespace: str,
        tensors: Sequence[HostTensor],
        metadata: dict[str, Any],
        value: Any,
        nbytes: int,
        *,
        wait: bool = False,
    ) -> bool:
        """Queue a record of a kind other than KV blocks (e.g. vision features).

        Args:
            kind: The record kind (a codec for it must be registered).
            key: Its key (image hash).
            namespace: Tenant storage namespace.
            tensors: Host views of its arrays.
            metadata: Its file metadata (must include what its codec checks).
            value: The in-memory record, returned by ``load`` while queued.
            nbytes: Bytes it takes in RAM.
            wait: Block while the queue is full instead of dropping.

        Returns:
            Whether the record is (or will be) on disk.
        """
        if kind not in self._codecs or kind is RecordKind.KV:
            raise ValueError(f"no record codec for kind {kind!r} (KV blocks go through spill)")
        if self._writer.pending(kind, key) is not None or self._index.use(kind, key, (), self._clock()):
            self._count(already_stored=1)
            return True
        row = IndexRow(kind, key, check_namespace(namespace), 0, nbytes, self._clock())
        job = WriteJob(self.layout.path(kind, namespace, key), tuple(tensors), metadata, row, value)
        return self._submit(job, wait)

    def contains(self, kind: RecordKind, key: bytes) -> bool:
        """Whether a record is on disk or queued."""
        return self._writer.pending(kind, key) is not None or bool(self._index.get(kind, [key]))

    def load(
        self, kind: RecordKind, key: bytes, namespace: str, decode: Callable[[ParsedFile], T]
    ) -> T | Any | None:
        """Read, verify and decode one record (engine thread).

        Args:
            kind: Record kind.
            key: Record key.
            namespace: Tenant storage namespace the caller expects it under.
            decode: Builds the value from the verified file; raises ``CorruptFileError`` when
                the content is not what the caller asked for.

        Returns:
            The queued in-memory value if the record still waits in the queue, else the decoded
            file of its index row; None when there is no row, the file is gone, or it failed
            (quarantined, row dropped).
        """
        job = self._writer.pending(kind, key)
        if job is not None and job.row.namespace == namespace:
            self._count(queue_reads=1)
            return job.value
        row = self._index.get(kind, [key]).get(key)
        if row is None or row.namespace != namespace:
            return None
        started = time.perf_counter()
        value = self._finish(self._fetch(kind, namespace, key), decode)
        self._count(read_seconds=time.perf_counter() - started)
        if value is not None:
            self._index.touch(kind, [key], self._clock())
        return value

    def _fetch(
        self,
        kind: RecordKind,
        namespace: str,
        key: bytes,
        buffers: list[bytearray] | None = None,
        slot: int = 0,
    ) -> _Fetched:
        """Read and verify one file (reader thread), into ``buffers[slot]`` when given (grown
        if too small); failures come back as values."""
        path = self.layout.path(kind, namespace, key)
        started = time.perf_counter()
        try:
            if buffers is None:
                data: bytearray | memoryview = read_file(path)
            else:
                data, buffers[slot] = read_file_into(path, buffers[slot])
        except FileNotFoundError:
            return _Fetched(kind, key, path, None, None, 0, 0.0)
        io_seconds = time.perf_counter() - started
        try:
            return _Fetched(kind, key, path, parse_file(data), None, len(data), io_seconds)
        except CorruptFileError as exc:
            return _Fetched(kind, key, path, None, exc, len(data), io_seconds)

    def _finish(self, fetched: _Fetched, decode: Callable[[ParsedFile], T]) -> T | None:
        """Decode a fetched file (engine thread); quarantine it when anything is wrong."""
        kind, key, path = fetched.kind, fetched.key, fetched.path
        if fetched.parsed is None and fetched.error is None:
            # Deleted for capacity since its row was read (or by hand): a miss.
            self._count(read_failures=1)
            self._drop_row(kind, key)
            return None
        try:
            if fetched.error is not None:
                raise fetched.error
            assert fetched.parsed is not None
            value = decode(fetched.parsed)
        except CorruptFileError as exc:
            log.warning("quarantining %s: %s", path, exc)
            self._quarantine(kind, key, path)
            return None
        self._count(reads=1, read_bytes=fetched.size, read_io_seconds=fetched.io_seconds)
        return value

    # -- lifecycle and stats -------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued record is written."""
        self._writer.flush()

    def close(self) -> None:
        """Write what is queued, close the index, release the directory lock (idempotent).

        Raises:
            RuntimeError: The writer thread had crashed (its exception is the cause).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._readers.shutdown(wait=True, cancel_futures=True)
            self._writer.close()
        finally:
            self._index.close()
            os.close(self._lock_fd)

    @property
    def budget_bytes(self) -> int:
        """Capacity in file bytes."""
        return self._budget

    def stats(self) -> SsdStats:
        """A snapshot of the counters."""
        queued = self._writer.queued
        with self._stats_lock:
            return SsdStats(**{**self._counters, "queued": queued})  # type: ignore[arg-type]

    # -- internals -----------------------------------------------------------------------------

    def _submit(self, job: WriteJob, wait: bool) -> bool:
        if self._writer.submit(job, wait=wait):
            return True
        self._count(drops=1)
        return False

    def _commit(self, job: WriteJob, size: int) -> None:
        """Writer thread: the file is in place; index it and keep within the budget."""
        row = dataclasses.replace(job.row, size=size)
        old = self._index.get(row.kind, [row.key]).get(row.key)
        self._index.put(row)
        self._count(
            spills=1,
            spilled_bytes=size,
            files=0 if old is not None else 1,
            bytes=size - (old.size if old is not None else 0),
        )
        self._enforce_capacity()

    def _write_failed(self, job: WriteJob, error: BaseException) -> None:
        self._count(write_errors=1)

    def _over_budget(self) -> bool:
        with self._stats_lock:
            return self._counters["bytes"] > self._budget

    def _enforce_capacity(self) -> None:
        while self._over_budget():
            victims = self._index.oldest(16)
            if not victims:
                return
            for row in victims:
                if not self._over_budget():
                    return
                if self._index.delete(row.kind, row.key) is None:
                    continue
                self.layout.path(row.kind, row.namespace, row.key).unlink(missing_ok=True)
                self._count(
                    files=-1, bytes=-row.size, capacity_deletions=1, capacity_deleted_bytes=row.size
                )

    def _drop_row(self, kind: RecordKind, key: bytes) -> None:
        row = self._index.delete(kind, key)
        if row is not None:
            self._count(files=-1, bytes=-row.size)

    def _quarantine(self, kind: RecordKind, key: bytes, path: Path) -> None:
        self._drop_row(kind, key)
        if quarantine(self.layout, kind, key, path) is not None:
            self._count(quarantined=1)

    def _validate(
        self, kind: RecordKind, path: Path, namespace: str, key: bytes, size: int
    ) -> IndexRow | None:
        codec = self._codecs.get(kind)
        if codec is None:
            return None
        try:
            data = read_file(path)
            return codec.index_row(parse_file(data), namespace, key, len(data), self._clock())
        except CorruptFileError as exc:
            log.warning("reconcile: removing invalid %s: %s", path, exc)
            return None

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta


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


def _lock(path: Path) -> int:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SsdTierBusyError(f"the SSD tier at {path.parent} is open in another tier or process") from None
    return fd
