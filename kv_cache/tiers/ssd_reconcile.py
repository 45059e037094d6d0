"""Startup reconcile of the SSD tier's files with its index, and quarantine of bad files.

After a crash the index and the directory trees can disagree in three ways, each repaired:

- a temp file (a write that never finished): removed;
- an index row whose file is missing (or is not the size recorded): the row is dropped, or the
  file re-validated and its row rewritten;
- a file without a row (a crash between the rename and the index commit, or a lost commit):
  adopted when it parses and verifies, else removed.

Files that fail on read later are not deleted but moved to ``quarantine/`` for inspection.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kv_cache.tiers.ssd_index import IndexRow, RecordKind, SsdIndex
from kv_cache.tiers.ssd_layout import FILE_SUFFIX, SsdLayout
from kv_cache.tiers.ssd_writer import TEMP_SUFFIX, fsync_dir

# (kind, path, namespace, key, file size) -> the row of a valid file, or None.
Validator = Callable[[RecordKind, Path, str, bytes, int], IndexRow | None]


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    """What one reconcile changed.

    Attributes:
        temp_removed: Temp files of unfinished writes removed.
        rows_dropped: Index rows without a (valid) file, dropped.
        adopted: Files without a row, verified and indexed.
        removed: Files that did not verify (or sat at a wrong path), removed.
        strays: Other files in the trees, left alone.
    """

    temp_removed: int = 0
    rows_dropped: int = 0
    adopted: int = 0
    removed: int = 0
    strays: int = 0


@dataclass(frozen=True, slots=True)
class _Found:
    path: Path
    namespace: str
    size: int


def reconcile(layout: SsdLayout, index: SsdIndex, validate: Validator) -> ReconcileReport:
    """Make ``index`` and the files of ``layout`` agree (see the module docstring)."""
    temp_removed = removed = strays = 0
    files: dict[tuple[RecordKind, bytes], _Found] = {}
    for kind in RecordKind:
        for entry in _walk(layout.tree(kind)):
            path = Path(entry.path)
            if entry.name.endswith(TEMP_SUFFIX):
                path.unlink(missing_ok=True)
                temp_removed += 1
                continue
            parsed = layout.parse(kind, path)
            if parsed is None:
                if entry.name.endswith(FILE_SUFFIX):
                    path.unlink(missing_ok=True)
                    removed += 1
                else:
                    strays += 1
                continue
            namespace, key = parsed
            files[(kind, key)] = _Found(path, namespace, entry.stat(follow_symlinks=False).st_size)

    rows_dropped = adopted = 0
    for row in index.rows():
        found = files.pop((row.kind, row.key), None)
        if found is not None and found.namespace == row.namespace and found.size == row.size:
            continue
        index.delete(row.kind, row.key)
        rows_dropped += 1
        if found is not None:
            files[(row.kind, row.key)] = found  # re-validate below, adopt if still good

    for (kind, key), found in sorted(files.items(), key=lambda item: str(item[1].path)):
        row = validate(kind, found.path, found.namespace, key, found.size)
        if row is None:
            found.path.unlink(missing_ok=True)
            removed += 1
        else:
            index.put(row)
            adopted += 1
    return ReconcileReport(temp_removed, rows_dropped, adopted, removed, strays)


def _walk(root: Path) -> list[os.DirEntry[str]]:
    """Every non-directory entry under ``root`` (none if it does not exist)."""
    out: list[os.DirEntry[str]] = []
    stack = [root]
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    else:
                        out.append(entry)
        except FileNotFoundError:
            continue
    return out


def quarantine(layout: SsdLayout, kind: RecordKind, key: bytes, path: Path) -> Path | None:
    """Move a bad file out of the tree, to ``quarantine/<kind>-<key>-<namespace>-<ns time>``.

    The namespace in the name lets tenant erasure and retention find a tenant's quarantined
    files without reading them (they are unreadable by definition).

    Returns:
        Its new path, or None when the file was already gone.
    """
    target_dir = layout.quarantine_dir
    target_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    parsed = layout.parse(kind, path)
    namespace = parsed[0] if parsed is not None else "unknown"
    target = target_dir / f"{kind.value}-{key.hex()}-{namespace}-{time.time_ns()}{FILE_SUFFIX}"
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return None
    fsync_dir(path.parent)
    return target


_QUARANTINED_RE = re.compile(r"(kv|vision)-([0-9a-f]+)-(.+)-(\d+)" + re.escape(FILE_SUFFIX))


@dataclass(frozen=True, slots=True)
class QuarantinedFile:
    """A file in ``quarantine/`` as its name describes it.

    Attributes:
        path: Where it is.
        kind: Record kind.
        key: Record key.
        namespace: Tenant storage namespace it was filed under.
        quarantined_ns: Wall-clock nanoseconds when it was moved there.
    """

    path: Path
    kind: RecordKind
    key: bytes
    namespace: str
    quarantined_ns: int


def quarantined_files(layout: SsdLayout) -> list[QuarantinedFile]:
    """The files in ``quarantine/`` named by ``quarantine`` (others are left out), by name."""
    out = []
    try:
        names = sorted(os.listdir(layout.quarantine_dir))
    except FileNotFoundError:
        return []
    for name in names:
        match = _QUARANTINED_RE.fullmatch(name)
        if match is not None:
            kind, key, namespace, stamp = match.groups()
            out.append(QuarantinedFile(
                layout.quarantine_dir / name, RecordKind(kind), bytes.fromhex(key), namespace, int(stamp)
            ))
    return out
