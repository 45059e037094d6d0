"""SQLite (WAL) index of the SSD tier: one row per stored file.

A row holds everything a lookup needs without touching the file (chain identity of a KV block:
parent, tokens, extra keys; flags; sizes) plus what capacity, retention and erasure need (last
access, when the content was first computed, tenant namespace, owners). The file is the source of truth for the payload, the row for
recency; startup reconcile makes the two agree again after a crash.

One connection is shared by the engine thread and the writer thread, serialized by a lock:
every statement is short (a primary-key read or a one-row write), and WAL keeps a crash
between statements harmless. ``synchronous=NORMAL``: a power loss may forget the last commits,
which reconcile repairs (a file without a row is adopted). ``secure_delete`` overwrites the
content of deleted rows; retention sweeps truncate the WAL afterwards (``checkpoint``) and
erasures rebuild the database (``compact``), so an erased row's key, tokens and owners do not
linger in the database files.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import numpy as np

from kv_cache.hashing import ExtraKey
from kv_cache.serialization import extra_from_json, extra_to_json

SCHEMA_VERSION = 2

# SQLite allows 32766 host parameters per statement; stay far below.
_BATCH = 500

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    kind TEXT NOT NULL,
    key BLOB NOT NULL,
    namespace TEXT NOT NULL,
    size INTEGER NOT NULL,
    nbytes INTEGER NOT NULL,
    last_access INTEGER NOT NULL,
    owners TEXT NOT NULL,
    parent BLOB,
    tokens BLOB,
    extra TEXT,
    partial INTEGER NOT NULL DEFAULT 0,
    checkpointed INTEGER NOT NULL DEFAULT 0,
    stored_at REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (kind, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_parent ON entries (parent);
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_access);
CREATE INDEX IF NOT EXISTS entries_ns_lru ON entries (namespace, last_access);
CREATE INDEX IF NOT EXISTS entries_ns_stored ON entries (namespace, stored_at);
"""

# Version 1 had no stored_at: its rows get 0 (the epoch), so any retention expires them, the
# safe reading of "unknown age".
_MIGRATE_FROM_1 = "ALTER TABLE entries ADD COLUMN stored_at REAL NOT NULL DEFAULT 0"

_COLUMNS = (
    "kind, key, namespace, size, nbytes, last_access, owners, parent, tokens, extra, partial, "
    "checkpointed, stored_at"
)


class RecordKind(StrEnum):
    """What a stored file holds (each kind has its own directory tree)."""

    KV = "kv"
    VISION = "vision"


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One stored file as the index knows it.

    Attributes:
        kind: Record kind.
        key: Block hash or image hash.
        namespace: Tenant storage namespace (a directory name).
        size: Bytes of the file.
        nbytes: Bytes the record takes in RAM once loaded.
        last_access: Wall-clock nanoseconds of the last store or use (LRU order).
        owners: Session ids that produced or used it.
        parent: KV only: digest of the previous block or root.
        tokens: KV only: the block's token ids.
        extra: KV only: the block's extra keys.
        partial: KV only: a trailing partial block.
        checkpointed: KV only: the payload carries a recurrent checkpoint.
        stored_at: Wall-clock seconds when the content was first computed (retention).
    """

    kind: RecordKind
    key: bytes
    namespace: str
    size: int
    nbytes: int
    last_access: int
    owners: tuple[str, ...] = ()
    parent: bytes | None = None
    tokens: tuple[int, ...] = ()
    extra: tuple[ExtraKey, ...] = ()
    partial: bool = False
    checkpointed: bool = False
    stored_at: float = 0.0


def _row(values: tuple) -> IndexRow:
    kind, key, namespace, size, nbytes, last, owners, parent, tokens, extra, partial, ckpt, stored = values
    return IndexRow(
        kind=RecordKind(kind),
        key=bytes(key),
        namespace=namespace,
        size=size,
        nbytes=nbytes,
        last_access=last,
        owners=tuple(json.loads(owners)),
        parent=None if parent is None else bytes(parent),
        tokens=() if tokens is None else tuple(np.frombuffer(tokens, dtype="<i4").tolist()),
        extra=() if extra is None else extra_from_json(json.loads(extra)),
        partial=bool(partial),
        checkpointed=bool(ckpt),
        stored_at=float(stored),
    )


class SsdIndex:
    """The index database at ``path`` (created if missing).

    Raises:
        ValueError: The database has another schema version.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # Autocommit (isolation_level=None): every statement is its own transaction unless we
        # open one; check_same_thread=False because access is serialized by self._lock.
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.execute("PRAGMA secure_delete=ON")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, 1, SCHEMA_VERSION):
            self._db.close()
            raise ValueError(f"SSD index {path} has schema version {version}, expected {SCHEMA_VERSION}")
        if version == 1:
            self._db.execute(_MIGRATE_FROM_1)
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put(self, row: IndexRow) -> None:
        """Insert or replace a row."""
        tokens = np.asarray(row.tokens, dtype="<i4").tobytes() if row.kind is RecordKind.KV else None
        extra = json.dumps(extra_to_json(row.extra)) if row.kind is RecordKind.KV else None
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO entries ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (
                    row.kind.value, row.key, row.namespace, row.size, row.nbytes,
                    row.last_access, json.dumps(sorted(row.owners)), row.parent, tokens, extra,
                    int(row.partial), int(row.checkpointed), float(row.stored_at),
                ),
            )

    def get(self, kind: RecordKind, keys: Sequence[bytes]) -> dict[bytes, IndexRow]:
        """Rows of ``keys`` that exist, by key."""
        found: dict[bytes, IndexRow] = {}
        with self._lock:
            for i in range(0, len(keys), _BATCH):
                batch = keys[i : i + _BATCH]
                marks = ",".join("?" * len(batch))
                for values in self._db.execute(
                    f"SELECT {_COLUMNS} FROM entries WHERE kind = ? AND key IN ({marks})",
                    (kind.value, *batch),
                ):
                    row = _row(values)
                    found[row.key] = row
        return found

    def children(self, parent: bytes) -> list[IndexRow]:
        """KV rows whose parent is ``parent``, by key."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE parent = ? AND kind = ? ORDER BY key",
                (parent, RecordKind.KV.value),
            ).fetchall()
        return [_row(values) for values in rows]

    def delete(self, kind: RecordKind, key: bytes) -> IndexRow | None:
        """Remove a row; returns it (None if absent)."""
        with self._lock:
            values = self._db.execute(
                f"DELETE FROM entries WHERE kind = ? AND key = ? RETURNING {_COLUMNS}",
                (kind.value, key),
            ).fetchone()
        return None if values is None else _row(values)

    def touch(self, kind: RecordKind, keys: Sequence[bytes], stamp: int) -> None:
        """Set ``last_access`` of existing rows."""
        with self._lock:
            for i in range(0, len(keys), _BATCH):
                batch = keys[i : i + _BATCH]
                marks = ",".join("?" * len(batch))
                self._db.execute(
                    f"UPDATE entries SET last_access = ? WHERE kind = ? AND key IN ({marks})",
                    (stamp, kind.value, *batch),
                )

    def use(
        self,
        kind: RecordKind,
        key: bytes,
        owners: Sequence[str],
        stamp: int,
        stored_at: float | None = None,
    ) -> bool:
        """Record a use of a stored row: newer ``last_access``, ``owners`` added.

        Args:
            kind: Record kind.
            key: Record key.
            owners: Sessions to add.
            stamp: The new ``last_access``.
            stored_at: When the caller's copy was computed: a row stored before it is stale
                (the content was computed again since, e.g. after it expired) and is left
                alone, for the caller to write the fresh copy over it.

        Returns:
            Whether the row exists and is not stale (then it was updated).
        """
        with self._lock:
            values = self._db.execute(
                "SELECT owners, stored_at FROM entries WHERE kind = ? AND key = ?", (kind.value, key)
            ).fetchone()
            if values is None or (stored_at is not None and values[1] < stored_at):
                return False
            merged = sorted(set(json.loads(values[0])) | set(owners))
            self._db.execute(
                "UPDATE entries SET last_access = ?, owners = ? WHERE kind = ? AND key = ?",
                (stamp, json.dumps(merged), kind.value, key),
            )
            return True

    def oldest(self, limit: int, namespaces: Collection[str] | None = None) -> list[IndexRow]:
        """The least recently used rows (of ``namespaces`` when given), oldest first."""
        where, params = "", ()
        if namespaces is not None:
            names = sorted(namespaces)
            if not names:
                return []
            where = f"WHERE namespace IN ({','.join('?' * len(names))})"
            params = tuple(names)
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries {where} ORDER BY last_access, kind, key LIMIT ?",
                (*params, limit),
            ).fetchall()
        return [_row(values) for values in rows]

    def namespace_totals(self) -> dict[str, tuple[int, int]]:
        """(rows, total file bytes) per namespace."""
        with self._lock:
            found = self._db.execute(
                "SELECT namespace, COUNT(*), SUM(size) FROM entries GROUP BY namespace"
            ).fetchall()
        return {ns: (int(count), int(size)) for ns, count, size in found}

    def of_namespace(self, namespace: str) -> list[IndexRow]:
        """Every row of one namespace, by kind and key."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE namespace = ? ORDER BY kind, key", (namespace,)
            ).fetchall()
        return [_row(values) for values in rows]

    def owned_by(self, namespace: str, owner: str) -> list[IndexRow]:
        """Rows of one namespace that list ``owner``, by kind and key."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE namespace = ? AND EXISTS "
                "(SELECT 1 FROM json_each(entries.owners) WHERE json_each.value = ?) "
                "ORDER BY kind, key",
                (namespace, owner),
            ).fetchall()
        return [_row(values) for values in rows]

    def stored_before(self, namespace: str, cutoff: float) -> list[IndexRow]:
        """Rows of one namespace whose content was stored before ``cutoff`` (expired)."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM entries WHERE namespace = ? AND stored_at < ? "
                "ORDER BY kind, key",
                (namespace, cutoff),
            ).fetchall()
        return [_row(values) for values in rows]

    def set_owners(self, kind: RecordKind, key: bytes, owners: Sequence[str]) -> bool:
        """Replace a row's owners. Returns whether the row exists."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE entries SET owners = ? WHERE kind = ? AND key = ?",
                (json.dumps(sorted(set(owners))), kind.value, key),
            )
            return cursor.rowcount > 0

    def compact(self) -> None:
        """Rebuild the database (VACUUM) and truncate the WAL: after an erasure, no page of the
        files keeps a deleted key, not even as a stale divider in an interior b-tree page.
        Costs a rewrite of the index; erasures are rare, sweeps use ``checkpoint``."""
        with self._lock:
            self._db.execute("VACUUM")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def checkpoint(self) -> None:
        """Fold the WAL into the database and truncate it (after erasure: deleted rows' old
        page images leave the WAL; ``secure_delete`` already zeroed them in the database)."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def rows(self) -> Iterator[IndexRow]:
        """Every row (a snapshot taken at the call)."""
        with self._lock:
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM entries ORDER BY kind, key").fetchall()
        return (_row(values) for values in rows)

    def totals(self) -> tuple[int, int]:
        """(rows, total file bytes)."""
        with self._lock:
            count, size = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM entries").fetchone()
        return int(count), int(size)
