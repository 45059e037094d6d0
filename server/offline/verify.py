"""Verification of every file of a model tree against its checksum, its path and its index row.

Each record file is read whole, its tensor-region checksum recomputed (``parse_file``), its
metadata decoded as the record kind its tree says (a KV block's identity fields must hash to its
block hash; vision features must name their image hash), and checked against where it lies
(model, tenant namespace, key) and against its index row (present, same namespace and size).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kv_cache.serialization import CorruptFileError, decode_block_meta, parse_file
from kv_cache.tiers.ssd_files import read_file
from kv_cache.tiers.ssd_index import IndexRow, RecordKind
from kv_cache.tiers.ssd_layout import FILE_SUFFIX
from kv_cache.tiers.ssd_writer import TEMP_SUFFIX
from server.offline.cache_dir import ModelTree
from vision_cache.ssd import check_record


class Verdict(enum.StrEnum):
    """What verification found about one file or row."""

    OK = "ok"
    CORRUPT = "corrupt"  # checksum, metadata or identity wrong: quarantine it
    UNINDEXED = "unindexed"  # valid, but no matching row (a server's reconcile adopts it)
    MISSING = "missing"  # a row whose file is gone
    STRAY = "stray"  # not a record file (temp files of unfinished writes, foreign files)


@dataclass(frozen=True, slots=True)
class Finding:
    """One file (or row) that is not OK.

    Attributes:
        verdict: What is wrong.
        kind: Record kind of its tree.
        path: The file (for a missing file: where it should be).
        key: The record key, when the path names one.
        namespace: The namespace, when the path names one.
        reason: Why.
    """

    verdict: Verdict
    kind: RecordKind
    path: Path
    key: bytes | None
    namespace: str | None
    reason: str


@dataclass(slots=True)
class TreeReport:
    """Verification of one model tree.

    Attributes:
        files: Record files checked.
        ok: Of those, fine.
        findings: Everything not fine, in path order.
    """

    files: int = 0
    ok: int = 0
    findings: list[Finding] = field(default_factory=list)


def record_files(tree: ModelTree) -> list[tuple[RecordKind, Path]]:
    """Every file under the tree's record directories, by kind then path."""
    out: list[tuple[RecordKind, Path]] = []
    for kind in RecordKind:
        root = tree.layout.tree(kind)
        for directory, _, names in os.walk(root):
            out.extend((kind, Path(directory) / name) for name in names)
    out.sort(key=lambda item: (item[0].value, str(item[1])))
    return out


def verify_tree(tree: ModelTree, advance: Callable[[str], None] | None = None) -> TreeReport:
    """Check every file and row of a model tree (read only).

    Args:
        tree: The open, locked tree.
        advance: Called once per file (a progress bar).

    Returns:
        The files checked and what is wrong.
    """
    report = TreeReport()
    rows = {(row.kind, row.key): row for row in tree.index.rows()}
    seen: set[tuple[RecordKind, bytes]] = set()
    for kind, path in record_files(tree):
        if advance is not None:
            advance(path.name)
        finding = _check_file(tree, kind, path, rows, seen)
        if path.name.endswith(FILE_SUFFIX) and not path.name.endswith(TEMP_SUFFIX):
            report.files += 1
        if finding is None:
            report.ok += 1
        else:
            report.findings.append(finding)
    for (kind, key), row in sorted(rows.items(), key=lambda item: (item[0][0].value, item[0][1])):
        if (kind, key) not in seen:
            path = tree.layout.path(kind, row.namespace, key)
            report.findings.append(
                Finding(Verdict.MISSING, kind, path, key, row.namespace, "no file for this index row")
            )
    return report


def _check_file(
    tree: ModelTree,
    kind: RecordKind,
    path: Path,
    rows: dict[tuple[RecordKind, bytes], IndexRow],
    seen: set[tuple[RecordKind, bytes]],
) -> Finding | None:
    where = tree.layout.parse(kind, path)
    if where is None:
        temp = path.name.endswith(TEMP_SUFFIX)
        reason = "temp file of an unfinished write" if temp else "not a record file name"
        return Finding(Verdict.STRAY, kind, path, None, None, reason)
    namespace, key = where
    try:
        data = read_file(path)
        parsed = parse_file(data)
        metadata = parsed.metadata
        fingerprint = str(metadata.get("fingerprint", ""))
        if fingerprint[:16] != tree.name:
            raise CorruptFileError(f"file of model {fingerprint!r} in the tree of {tree.name}")
        if kind is RecordKind.KV:
            meta = decode_block_meta(parsed, fingerprint, list(metadata.get("families", ())))
            if meta.block_hash != key or meta.namespace != namespace:
                raise CorruptFileError(
                    f"holds block {meta.block_hash.hex()} of {meta.namespace!r}"
                )
        else:
            check_record(parsed, fingerprint, namespace, key)
    except CorruptFileError as exc:
        seen.add((kind, key))  # a row for it is not "missing": the file is bad
        return Finding(Verdict.CORRUPT, kind, path, key, namespace, str(exc))
    seen.add((kind, key))
    row = rows.get((kind, key))
    if row is None:
        return Finding(Verdict.UNINDEXED, kind, path, key, namespace, "no index row")
    if row.namespace != namespace or row.size != len(data):
        return Finding(
            Verdict.UNINDEXED, kind, path, key, namespace,
            f"index row says {row.size} bytes in {row.namespace!r}, file has {len(data)} in {namespace!r}",
        )
    return None
