"""Counters of the SSD tier."""

from __future__ import annotations

from dataclasses import dataclass


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
        read_seconds: Engine-thread time spent loading records (waiting for reads, decoding).
        read_io_seconds: Reader-thread time spent in file reads (summed over parallel reads,
            so it can exceed the wall time).
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
    read_io_seconds: float = 0.0
    queue_reads: int = 0
    read_failures: int = 0
    quarantined: int = 0
    reconcile_temp_removed: int = 0
    reconcile_rows_dropped: int = 0
    reconcile_adopted: int = 0
    reconcile_removed: int = 0
