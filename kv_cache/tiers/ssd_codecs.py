"""How the SSD tier recognises each kind of record on disk, and KV blocks' index rows."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from kv_cache.hashing import BlockHash
from kv_cache.serialization import BlockMeta, CorruptFileError, ParsedFile, decode_block_meta, parse_file
from kv_cache.tiers.ssd_files import read_file
from kv_cache.tiers.ssd_index import IndexRow, RecordKind

log = logging.getLogger(__name__)


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
        stored_at=meta.stored_at,
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
        stored_at=row.stored_at,
    )


def validate_record(
    codecs: Mapping[RecordKind, RecordCodec],
    clock: Callable[[], int],
    kind: RecordKind,
    path: Path,
    namespace: str,
    key: bytes,
    size: int,
) -> IndexRow | None:
    """Reconcile's validator: the row of a verified file found at ``(namespace, key)``; None
    for a file that does not verify (or of a kind without a codec)."""
    codec = codecs.get(kind)
    if codec is None:
        return None
    try:
        data = read_file(path)
        return codec.index_row(parse_file(data), namespace, key, len(data), clock())
    except CorruptFileError as exc:
        log.warning("reconcile: removing invalid %s: %s", path, exc)
        return None
