"""SSD tier: cache records (KV blocks, vision features) as checksummed files, indexed in SQLite.

```
 RAM eviction --spill(block)--> host views --SsdWriter queue--> file + index row
                                   full: dropped (counted)       (temp, fsync, rename, fsync dir)
 lookup  --find_blocks / children--> index rows (+ queued records): no disk read
 promote --load_block--> queued record, or file read -> parse -> checksum -> identity -> payload
                              any failure: file to quarantine/, row dropped, a miss
 startup: lock, reconcile (temp files, rows without files, files without rows), capacity
 capacity: a tenant over its quota loses its own least recently used files; total file bytes
           <= budget, least recently used first among the writing tenant and the tenants
           above their guarantee (``kv_cache.tiers.quota``)
 retention: rows carry stored_at; ``expire`` deletes expired rows + files, reads skip them
 erasure:  ``delete`` (keys), ``erase_namespace`` (a tenant): rows, files, emptied directories
```

Records of each kind are described by a ``RecordCodec`` (KV blocks: ``ssd_codecs``; vision
features: ``vision_cache.ssd``): it turns a verified file into its index row, for reconcile.

Threads: the engine thread calls everything public; the writer thread writes files, inserts
rows and enforces the capacity. Counters are guarded by one lock, per-tenant usage (and every
capacity pass) by another.

One process per (cache dir, model): an exclusive ``flock`` on ``ssd/<fp16>/lock`` is held while
the tier is open (a second opener gets ``SsdTierBusyError``); the kernel drops it when the
process dies, so a crashed server never blocks its successor.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
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
)
from kv_cache.tally import Tally
from kv_cache.tiers import ssd_maintenance
from kv_cache.tiers.ssd_capacity import SsdCapacity
from kv_cache.tiers.ssd_codecs import BlockCodec, RecordCodec, block_row, row_meta, validate_record
from kv_cache.tiers.ssd_files import Fetched, SsdTierBusyError, fetch_file, lock_tier
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

__all__ = ["DEFAULT_QUEUE_SIZE", "DEFAULT_SSD_BUDGET", "LoadedRecord", "SsdTier", "SsdTierBusyError"]


@dataclass(frozen=True, slots=True)
class LoadedRecord:
    """A record read back by ``SsdTier.load``.

    Attributes:
        value: The decoded record (or the queued in-memory one).
        stored_at: When its content was first computed (retention).
        owners: Sessions its row lists.
    """

    value: Any
    stored_at: float
    owners: tuple[str, ...]


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
        clock: Wall-clock nanoseconds for LRU stamps (they must survive restarts) and for
            ``stored_at`` of records that come without one.

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
        self._lock_fd = lock_tier(self.layout.lock_path)
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
            report = reconcile(self.layout, self._index, partial(validate_record, self._codecs, self._clock))
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
            self._capacity = SsdCapacity(self._index, self.layout, budget_bytes)
            self._enforce_capacity(None)
        except BaseException:
            self.close()
            raise

    # -- KV blocks -----------------------------------------------------------------------------

    def spill(self, block: Block, *, wait: bool = False) -> bool:
        """Queue an evicted block for writing (the prefix cache's ``on_evict``).

        A block already on disk or queued only has its recency and owners updated, unless the
        stored copy is older than the block (computed again since, e.g. after it expired): then
        the fresh copy replaces it.

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
        stored_at = block.stored_at if block.stored_at is not None else self._now()
        if self._writer.pending(RecordKind.KV, key) is not None or self._index.use(
            RecordKind.KV, key, tuple(block.owners), self._clock(), stored_at
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
            stored_at=stored_at,
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
        fetches: dict[int, Future[Fetched]] = {}

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
        owners: Sequence[str] = (),
        stored_at: float | None = None,
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
            owners: Sessions that produced it (added to a stored row's owners).
            stored_at: When its content was computed (None: now); its metadata should carry
                the same value for reconcile.
            wait: Block while the queue is full instead of dropping.

        Returns:
            Whether the record is (or will be) on disk.
        """
        if kind not in self._codecs or kind is RecordKind.KV:
            raise ValueError(f"no record codec for kind {kind!r} (KV blocks go through spill)")
        stored_at = self._now() if stored_at is None else stored_at
        if self._writer.pending(kind, key) is not None or self._index.use(
            kind, key, tuple(owners), self._clock(), stored_at
        ):
            self._count(already_stored=1)
            return True
        row = IndexRow(
            kind, key, check_namespace(namespace), 0, nbytes, self._clock(),
            owners=tuple(sorted(set(owners))), stored_at=stored_at,
        )
        job = WriteJob(self.layout.path(kind, namespace, key), tuple(tensors), metadata, row, value)
        return self._submit(job, wait)

    def contains(self, kind: RecordKind, key: bytes) -> bool:
        """Whether a record is on disk or queued."""
        return self._writer.pending(kind, key) is not None or bool(self._index.get(kind, [key]))

    def load(
        self,
        kind: RecordKind,
        key: bytes,
        namespace: str,
        decode: Callable[[ParsedFile], T],
        *,
        expired_before: float | None = None,
    ) -> LoadedRecord | None:
        """Read, verify and decode one record (engine thread).

        Args:
            kind: Record kind.
            key: Record key.
            namespace: Tenant storage namespace the caller expects it under.
            decode: Builds the value from the verified file; raises ``CorruptFileError`` when
                the content is not what the caller asked for.
            expired_before: Retention cutoff: a record stored before it is expired, never
                returned, and deleted (row and file).

        Returns:
            The queued in-memory value if the record still waits in the queue, else the decoded
            file of its index row; None when there is no row, it expired, the file is gone, or
            it failed (quarantined, row dropped).
        """
        job = self._writer.pending(kind, key)
        if job is not None and job.row.namespace == namespace:
            if expired_before is not None and job.row.stored_at < expired_before:
                return None  # the writer will land it; the next sweep or read deletes it
            self._count(queue_reads=1)
            return LoadedRecord(job.value, job.row.stored_at, job.row.owners)
        row = self._index.get(kind, [key]).get(key)
        if row is None or row.namespace != namespace:
            return None
        if expired_before is not None and row.stored_at < expired_before:
            self.delete(kind, [key])
            return None
        started = time.perf_counter()
        value = self._finish(self._fetch(kind, namespace, key), decode)
        self._count(read_seconds=time.perf_counter() - started)
        if value is None:
            return None
        self._index.touch(kind, [key], self._clock())
        return LoadedRecord(value, row.stored_at, row.owners)

    def _fetch(
        self,
        kind: RecordKind,
        namespace: str,
        key: bytes,
        buffers: list[bytearray] | None = None,
        slot: int = 0,
    ) -> Fetched:
        """Read and verify one file (reader thread), into ``buffers[slot]`` when given."""
        return fetch_file(self.layout.path(kind, namespace, key), kind, key, buffers, slot)

    def _finish(self, fetched: Fetched, decode: Callable[[ParsedFile], T]) -> T | None:
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

    # -- tenants: quotas, retention, erasure ----------------------------------------------------

    def set_quota(self, namespace: str, quota_bytes: int | None) -> None:
        """Set (or with None remove) a tenant's quota in file bytes, deleting its own least
        recently used files until it fits."""
        self._count_capacity(self._capacity.set_quota(namespace, quota_bytes))

    def usage(self) -> dict[str, int]:
        """File bytes per tenant namespace (a snapshot)."""
        return self._capacity.usage()

    def owned_rows(self, namespace: str, owner: str) -> list[IndexRow]:
        """Rows of a namespace that list ``owner`` (call ``flush`` first to include queued
        records)."""
        return self._index.owned_by(namespace, owner)

    def rows_of(self, kind: RecordKind, keys: Sequence[bytes]) -> dict[bytes, IndexRow]:
        """Index rows of those of ``keys`` that are stored (queued ones are not included)."""
        return self._index.get(kind, list(keys))

    def set_owners(self, kind: RecordKind, key: bytes, owners: Sequence[str]) -> None:
        """Replace a stored record's owners (erasure of a session that shares it)."""
        self._index.set_owners(kind, key, owners)

    def add_owner(self, kind: RecordKind, key: bytes, owner: str) -> None:
        """Record that ``owner`` uses a stored record (no-op if it is not stored)."""
        self._index.use(kind, key, (owner,), self._clock())

    def delete(self, kind: RecordKind, keys: Sequence[bytes]) -> Tally:
        """Delete stored records (rows, files, emptied directories); queued ones are written
        first, so none lands afterwards.

        Returns:
            The files deleted and their bytes.
        """
        self.flush()
        rows = self._index.get(kind, list(keys)).values()
        deleted = ssd_maintenance.delete_rows(self._index, self.layout, rows)
        ssd_maintenance.prune_namespace_dirs(self.layout, deleted)
        self._forget(deleted)
        return ssd_maintenance.tallies(deleted)[kind]

    def erase_namespace(self, namespace: str) -> dict[RecordKind, Tally]:
        """Delete every record of a tenant (after writing what is queued, so none lands
        afterwards), its quarantined files and its emptied directories.

        Returns:
            Files deleted and their bytes, per record kind.
        """
        self.flush()
        deleted = ssd_maintenance.erase_namespace(self._index, self.layout, check_namespace(namespace))
        self._forget(deleted)
        self._index.compact()
        return ssd_maintenance.tallies(deleted)

    def expire(self, cutoffs: Mapping[str, float]) -> dict[RecordKind, Tally]:
        """Delete the records of each namespace stored before its cutoff (after writing what is
        queued).

        Args:
            cutoffs: ``now - retention`` per namespace with a retention.

        Returns:
            Files deleted and their bytes, per record kind.
        """
        if not cutoffs:
            return ssd_maintenance.tallies(())
        self.flush()
        deleted = ssd_maintenance.expire(self._index, self.layout, cutoffs)
        ssd_maintenance.prune_namespace_dirs(self.layout, deleted)
        self._forget(deleted)
        if deleted:
            self._index.checkpoint()
        return ssd_maintenance.tallies(deleted)

    def checkpoint(self) -> None:
        """Truncate the index's WAL (deleted rows leave no page images in it)."""
        self._index.checkpoint()

    def compact(self) -> None:
        """Rebuild the index and truncate its WAL (after an erasure: no trace of deleted keys)."""
        self._index.compact()

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
        """Writer thread: the file is in place; index it and keep within quota and budget."""
        row = dataclasses.replace(job.row, size=size)
        old = self._capacity.commit(row)
        self._count(
            spills=1,
            spilled_bytes=size,
            files=0 if old is not None else 1,
            bytes=size - (old.size if old is not None else 0),
        )
        self._enforce_capacity(row.namespace)

    def _write_failed(self, job: WriteJob, error: BaseException) -> None:
        self._count(write_errors=1)

    def _enforce_capacity(self, requester: str | None) -> None:
        self._count_capacity(self._capacity.enforce(requester))

    def _count_capacity(self, deleted: list[IndexRow]) -> None:
        if deleted:
            size = sum(row.size for row in deleted)
            self._count(
                files=-len(deleted), bytes=-size, capacity_deletions=len(deleted),
                capacity_deleted_bytes=size,
            )

    def _forget(self, rows: Sequence[IndexRow]) -> None:
        """Account rows deleted outside a capacity pass."""
        if not rows:
            return
        self._capacity.forget(list(rows))
        self._count(files=-len(rows), bytes=-sum(row.size for row in rows))

    def _now(self) -> float:
        """Wall-clock seconds of the tier's clock."""
        return self._clock() / 1e9

    def _drop_row(self, kind: RecordKind, key: bytes) -> None:
        row = self._index.delete(kind, key)
        if row is not None:
            self._forget([row])

    def _quarantine(self, kind: RecordKind, key: bytes, path: Path) -> None:
        self._drop_row(kind, key)
        if quarantine(self.layout, kind, key, path) is not None:
            self._count(quarantined=1)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                self._counters[name] += delta
