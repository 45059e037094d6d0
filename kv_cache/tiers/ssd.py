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

Records of each kind are described by a ``RecordCodec`` (KV blocks here, vision features in
``vision_cache.ssd``): it turns a verified file into its index row, for reconcile.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

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
    decode_block_meta,
    parse_file,
)
from kv_cache.tiers.ssd_index import IndexRow, RecordKind, SsdIndex
from kv_cache.tiers.ssd_layout import SsdLayout, check_namespace
from kv_cache.tiers.ssd_reconcile import ReconcileReport, quarantine, reconcile
from kv_cache.tiers.ssd_writer import SsdWriter, WriteJob

log = logging.getLogger(__name__)

DEFAULT_SSD_BUDGET = 10 * 2**30
DEFAULT_QUEUE_SIZE = 64

T = TypeVar("T")


class SsdTierBusyError(RuntimeError):
    """Another open tier (this process or another) holds the cache directory for this model."""


class RecordCodec(Protocol):
    """How the tier recognises one kind of record on disk."""

    kind: RecordKind

    def index_row(
        self, parsed: ParsedFile, namespace: str, key: bytes, size: int, stamp: int
    ) -> IndexRow:
        """The index row of a verified file found at ``(namespace, key)``.

        Raises:
            CorruptFileError: The metadata is not a valid record of this kind for this model at
                this path.
        """
        ...


@dataclass(frozen=True, slots=True)
class SsdStats:
    """Counters of one SSD tier (a snapshot).

    Attributes:
        files: Records on disk (indexed).
        bytes: Their total file bytes.
        budget_bytes: Capacity; least recently used files are deleted above it.
        queued: Records waiting in the write queue.
        spills: Files written.
        spilled_bytes: Bytes of those files.
        drops: Records not written because the queue was full.
        already_stored: Spills skipped because the record was already on disk or queued.
        unfiled: Evicted blocks without a tenant namespace (not written).
        write_errors: Writes that failed with an I/O error.
        capacity_deletions: Files deleted to stay within the budget.
        capacity_deleted_bytes: Bytes of those files.
        reads: Files read and verified.
        read_bytes: Bytes of those files.
        read_seconds: Time spent reading, verifying and decoding them.
        queue_reads: Records served from the write queue (no disk read).
        read_failures: Reads of files that had gone (deleted for capacity meanwhile).
        quarantined: Files that failed to parse or verify, moved to ``quarantine/``.
        reconcile_temp_removed: Startup reconcile: temp files removed.
        reconcile_rows_dropped: Startup reconcile: rows without a file dropped.
        reconcile_adopted: Startup reconcile: files without a row adopted.
        reconcile_removed: Startup reconcile: invalid files removed.
    """

    files: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    queued: int = 0
    spills: int = 0
    spilled_bytes: int = 0
    drops: int = 0
    already_stored: int = 0
    unfiled: int = 0
    write_errors: int = 0
    capacity_deletions: int = 0
    capacity_deleted_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    queue_reads: int = 0
    read_failures: int = 0
    quarantined: int = 0
    reconcile_temp_removed: int = 0
    reconcile_rows_dropped: int = 0
    reconcile_adopted: int = 0
    reconcile_removed: int = 0


class BlockCodec:
    """KV blocks: the row carries the chain identity lookups verify against."""

    kind = RecordKind.KV

    def __init__(self, fingerprint: str, families: Sequence[str]) -> None:
        self._fingerprint = fingerprint
        self._families = tuple(families)

    def index_row(
        self, parsed: ParsedFile, namespace: str, key: bytes, size: int, stamp: int
    ) -> IndexRow:
        meta = decode_block_meta(parsed, self._fingerprint, self._families)
        if meta.block_hash != key or meta.namespace != namespace:
            raise CorruptFileError(
                f"file of block {meta.block_hash.hex()} in {meta.namespace!r} found at "
                f"{key.hex()} in {namespace!r}"
            )
        return block_row(meta, size, stamp)


def block_row(meta: BlockMeta, size: int, stamp: int) -> IndexRow:
    """The index row of a block."""
    return IndexRow(
        kind=RecordKind.KV,
        key=meta.block_hash,
        namespace=meta.namespace,
        size=size,
        nbytes=meta.nbytes,
        last_access=stamp,
        owners=tuple(sorted(meta.owners)),
        parent=meta.parent,
        tokens=meta.tokens,
        extra=meta.extra,
        partial=meta.partial,
        checkpointed=meta.checkpointed,
    )


def row_meta(row: IndexRow) -> BlockMeta:
    """A KV row's block identity."""
    assert row.kind is RecordKind.KV and row.parent is not None
    return BlockMeta(
        block_hash=BlockHash(row.key),
        parent=BlockHash(row.parent),
        tokens=row.tokens,
        extra=row.extra,
        partial=row.partial,
        checkpointed=row.checkpointed,
        namespace=row.namespace,
        owners=row.owners,
        nbytes=row.nbytes,
    )


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
        self._counters = SsdStats(budget_bytes=budget_bytes)
        self._stats_lock = threading.Lock()
        self._closed = False
        try:
            self._index = SsdIndex(self.layout.index_path)
        except BaseException:
            os.close(self._lock_fd)
            raise
        # Started before reconcile (it idles until the first spill) so that every attribute
        # exists from here on.
        self._writer = SsdWriter(queue_size, self._commit, self._write_failed)
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

    def load_block(self, meta: BlockMeta) -> BlockPayload | None:
        """The payload of a stored block whose identity is ``meta``, verified.

        Returns:
            The payload; None when the file is gone or failed verification (it is then
            quarantined and its row dropped).
        """
        key = bytes(meta.block_hash)

        def decode(parsed: ParsedFile) -> BlockPayload:
            stored, payload = decode_block(parsed, self._fingerprint, self._families)
            if (stored.block_hash, stored.parent, stored.tokens, stored.extra, stored.partial) != (
                meta.block_hash, meta.parent, meta.tokens, meta.extra, meta.partial
            ):
                raise CorruptFileError(f"file of block {key.hex()} holds another block's identity")
            return payload

        return self.load(RecordKind.KV, key, meta.namespace, decode)

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
            file; None when there is no such file or it failed (quarantined, row dropped).
        """
        job = self._writer.pending(kind, key)
        if job is not None and job.row.namespace == namespace:
            self._count(queue_reads=1)
            return job.value
        path = self.layout.path(kind, namespace, key)
        start = time.perf_counter()
        try:
            data = read_file(path)
        except FileNotFoundError:
            self._count(read_failures=1)
            self._drop_row(kind, key)
            return None
        try:
            value = decode(parse_file(data))
        except CorruptFileError as exc:
            log.warning("quarantining %s: %s", path, exc)
            self._quarantine(kind, key, path)
            return None
        self._count(reads=1, read_bytes=len(data), read_seconds=time.perf_counter() - start)
        self._index.touch(kind, [key], self._clock())
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
            self._writer.close()
        finally:
            self._index.close()
            os.close(self._lock_fd)

    def stats(self) -> SsdStats:
        """A snapshot of the counters."""
        queued = self._writer.queued
        with self._stats_lock:
            return dataclasses.replace(self._counters, queued=queued)

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
            return self._counters.bytes > self._budget

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
            c = self._counters
            self._counters = dataclasses.replace(
                c, **{name: getattr(c, name) + delta for name, delta in deltas.items()}
            )


def read_file(path: Path) -> bytearray:
    """A whole file in one buffer (raises FileNotFoundError when it is gone)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view = memoryview(buf)
        done = 0
        while done < size:
            count = f.readinto(view[done:])
            if not count:
                break
            done += count
    return buf if done == size else buf[:done]


def _lock(path: Path) -> int:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SsdTierBusyError(f"the SSD tier at {path.parent} is open in another tier or process") from None
    return fd
