"""Cache records on disk: safetensors files whose metadata carries identity and a checksum.

```
 file   = u64 LE header length N | N bytes of JSON header (space padded) | tensor bytes
 header = {"__metadata__": {"vlmcache": "<JSON of the record's metadata>"},
           "<tensor name>": {"dtype": "F32", "shape": [...], "data_offsets": [a, b]}, ...}
```

That is the plain safetensors layout (``safetensors`` and ``mx.load`` read these files), written
by hand so that the bytes go straight from the arrays' host memory to the file, bf16 included
(numpy has no bf16: tensors travel as raw unsigned integers of the same width). The metadata
holds ``checksum``, the xxh3_128 of the whole tensor region, and every reader verifies it; a
block's identity fields are verified by recomputing its chained hash, so a flipped byte anywhere
in a file is caught (or, in header whitespace, harmless).

Two record kinds live in such files: KV blocks (``BlockPayload`` + the block's chain identity,
here) and vision features (``vision_cache.ssd``). Splitting the work by thread: ``host_tensor``
touches MLX and runs on the engine thread (a zero-copy view of an evaluated array);
``prepare_file`` and ``parse_file`` are pure byte work for the writer thread and readers;
``to_array`` builds MLX arrays again on the engine thread.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from kv_cache.families.base import LayerCheckpoint, LayerSlice
from kv_cache.hashing import (
    CACHE_FORMAT_VERSION,
    BlockHash,
    ExtraKey,
    check_digest,
    hash_block,
)
from kv_cache.payload import BlockPayload
from vision_cache.hashing import ImageHash

assert sys.byteorder == "little", "the on-disk format stores host (little-endian) bytes"

# Version of the file layout and metadata schema (independent of CACHE_FORMAT_VERSION, which
# changes what a block *means*; both are checked on read).
FILE_FORMAT_VERSION = 1
METADATA_KEY = "vlmcache"
KV_BLOCK_FORMAT = "vlmcache.kv_block"

# Largest header we accept: a block's header is a few KB; anything near this is corruption.
MAX_HEADER_BYTES = 16 * 2**20
_U64 = struct.Struct("<Q")
_ALIGN = 8


class CorruptFileError(ValueError):
    """A stored file is not a valid record (parse, checksum or identity failure)."""


@dataclass(frozen=True, slots=True)
class _DType:
    name: str  # safetensors dtype string
    mx_dtype: mx.Dtype
    raw_mx: mx.Dtype  # unsigned integer of the same width: the bytes travel as this
    raw_np: np.dtype


def _dtype_table() -> tuple[_DType, ...]:
    u = {1: (mx.uint8, np.dtype("<u1")), 2: (mx.uint16, np.dtype("<u2")),
         4: (mx.uint32, np.dtype("<u4")), 8: (mx.uint64, np.dtype("<u8"))}
    pairs = (
        ("F32", mx.float32), ("F16", mx.float16), ("BF16", mx.bfloat16), ("F64", mx.float64),
        ("I8", mx.int8), ("I16", mx.int16), ("I32", mx.int32), ("I64", mx.int64),
        ("U8", mx.uint8), ("U16", mx.uint16), ("U32", mx.uint32), ("U64", mx.uint64),
        ("BOOL", mx.bool_),
    )
    return tuple(_DType(name, dt, *u[dt.size]) for name, dt in pairs)


_DTYPES = _dtype_table()
_BY_NAME = {d.name: d for d in _DTYPES}
_BY_MX = {d.mx_dtype: d for d in _DTYPES}


@dataclass(frozen=True, slots=True)
class HostTensor:
    """One tensor's bytes in host memory, ready to be written by any thread.

    Attributes:
        name: Tensor name in the file.
        dtype: safetensors dtype string (``F32``, ``BF16``, ...).
        shape: The array's shape.
        data: The raw bytes as a flat uint8 array (a zero-copy view of the array when it is
            contiguous; the view keeps the array alive).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def host_tensor(name: str, array: mx.array) -> HostTensor:
    """A host view of an MLX array's bytes (engine thread: the array must be evaluated).

    Raises:
        TypeError: The dtype has no safetensors name here.
    """
    spec = _BY_MX.get(array.dtype)
    if spec is None:
        raise TypeError(f"tensor {name!r}: dtype {array.dtype} cannot be stored")
    raw = np.ascontiguousarray(np.asarray(array.view(spec.raw_mx))).reshape(-1).view(np.uint8)
    return HostTensor(name, spec.name, tuple(int(d) for d in array.shape), raw)


def to_array(dtype: str, shape: Sequence[int], data: memoryview) -> mx.array:
    """An MLX array (a copy) from a tensor's raw bytes as parsed from a file."""
    spec = _BY_NAME[dtype]
    raw = np.frombuffer(data, dtype=spec.raw_np).reshape(tuple(shape))
    array = mx.array(raw)
    return array if spec.raw_mx == spec.mx_dtype else array.view(spec.mx_dtype)


@dataclass(frozen=True, slots=True)
class PreparedFile:
    """A complete file as a header plus the tensors' bytes (written without joining them)."""

    header: bytes
    tensors: tuple[HostTensor, ...]
    checksum: str

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)

    def chunks(self) -> list[memoryview]:
        """The file's bytes in order."""
        return [memoryview(self.header)] + [memoryview(t.data) for t in self.tensors]


def prepare_file(tensors: Sequence[HostTensor], metadata: Mapping[str, Any]) -> PreparedFile:
    """Checksum the tensors and build the safetensors header (pure byte work, any thread).

    Args:
        tensors: The tensors, in file order.
        metadata: JSON-serialisable record metadata; ``checksum`` is added.

    Returns:
        The file, ready for ``chunks()``.
    """
    names = [t.name for t in tensors]
    if len(set(names)) != len(names) or METADATA_KEY in names or "__metadata__" in names:
        raise ValueError(f"tensor names must be unique and not reserved: {names}")
    digest = xxhash.xxh3_128()
    entries: dict[str, Any] = {}
    offset = 0
    for t in tensors:
        digest.update(memoryview(t.data))
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape),
                           "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    checksum = digest.hexdigest()
    meta = {**metadata, "checksum": checksum}
    header = {"__metadata__": {METADATA_KEY: json.dumps(meta, separators=(",", ":"))}, **entries}
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body += b" " * (-(len(body) + _U64.size) % _ALIGN)
    return PreparedFile(_U64.pack(len(body)) + body, tuple(tensors), checksum)


@dataclass(frozen=True, slots=True)
class ParsedTensor:
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


@dataclass(frozen=True, slots=True)
class ParsedFile:
    """A verified file: its metadata (checksum matched) and its tensors' raw bytes."""

    metadata: dict[str, Any]
    tensors: dict[str, ParsedTensor]


def parse_file(data: bytes | bytearray | memoryview) -> ParsedFile:
    """Parse and verify a whole file's bytes.

    Raises:
        CorruptFileError: Naming what is wrong: truncated, bad header, unknown dtype,
            overlapping or missing tensor bytes, checksum mismatch.
    """
    view = memoryview(data).cast("B")
    if len(view) < _U64.size:
        raise CorruptFileError(f"truncated: {len(view)} bytes")
    (header_len,) = _U64.unpack_from(view, 0)
    if header_len > MAX_HEADER_BYTES or _U64.size + header_len > len(view):
        raise CorruptFileError(f"header length {header_len} does not fit a {len(view)}-byte file")
    try:
        header = json.loads(bytes(view[_U64.size : _U64.size + header_len]).decode("utf-8"))
        meta = json.loads(header.pop("__metadata__")[METADATA_KEY])
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptFileError(f"unreadable header: {exc!r}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("checksum"), str):
        raise CorruptFileError("metadata without a checksum")
    body = view[_U64.size + header_len :]
    spans = []
    tensors: dict[str, ParsedTensor] = {}
    try:
        for name, entry in header.items():
            spec = _BY_NAME[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
            count = 1
            for d in shape:
                if d < 0:
                    raise ValueError(f"negative dimension in {shape}")
                count *= d
            if not 0 <= start <= end or end - start != count * spec.mx_dtype.size:
                raise ValueError(f"tensor {name!r}: offsets {start}..{end} for shape {shape}")
            spans.append((start, end))
            tensors[name] = ParsedTensor(spec.name, shape, body[start:end])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptFileError(f"bad tensor table: {exc!r}") from None
    spans.sort()
    position = 0
    for start, end in spans:
        if start != position:
            raise CorruptFileError(f"tensor bytes have a hole or overlap at offset {position}")
        position = end
    if position != len(body):
        raise CorruptFileError(f"tensor bytes end at {position}, file body is {len(body)} bytes")
    digest = xxhash.xxh3_128()
    for start, end in spans:
        digest.update(body[start:end])
    if digest.hexdigest() != meta["checksum"]:
        raise CorruptFileError(f"checksum mismatch: stored {meta['checksum']}, computed {digest.hexdigest()}")
    return ParsedFile(meta, tensors)


# -- KV blocks -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """A stored block's identity, as recorded in its file and in the SSD index.

    Attributes:
        block_hash: The block's chained digest.
        parent: Digest of the previous block or the root.
        tokens: The block's token ids.
        extra: Extra keys (image hash, offset) of the images overlapping it.
        partial: Whether it is a trailing partial block.
        checkpointed: Whether its payload carries a recurrent-state checkpoint.
        namespace: Tenant storage namespace.
        owners: Session ids that produced or reused it.
        nbytes: Bytes of the payload in RAM (what promoting it charges).
        stored_at: Wall-clock seconds when the content was first computed (retention).
    """

    block_hash: BlockHash
    parent: BlockHash
    tokens: tuple[int, ...]
    extra: tuple[ExtraKey, ...]
    partial: bool
    checkpointed: bool
    namespace: str
    owners: tuple[str, ...]
    nbytes: int
    stored_at: float = 0.0


def extra_to_json(extra: Sequence[ExtraKey]) -> list[list[Any]]:
    return [[bytes(h).hex(), int(offset)] for h, offset in extra]


def extra_from_json(value: Any) -> tuple[ExtraKey, ...]:
    return tuple((ImageHash(bytes.fromhex(h)), int(offset)) for h, offset in value)


def block_tensors(payload: BlockPayload) -> tuple[HostTensor, ...]:
    """Host views of a payload's arrays (engine thread)."""
    out: list[HostTensor] = []
    for i, piece in enumerate(payload.layers):
        if piece is not None:
            out.append(host_tensor(f"layer.{i}.keys", piece.keys))
            out.append(host_tensor(f"layer.{i}.values", piece.values))
    for i, ckpt in enumerate(payload.checkpoint or ()):
        if ckpt is not None:
            out.extend(host_tensor(f"checkpoint.{i}.{j}", a) for j, a in enumerate(ckpt.arrays))
    return tuple(out)


def block_metadata(
    meta: BlockMeta, payload: BlockPayload, fingerprint: str, families: Sequence[str]
) -> dict[str, Any]:
    """The JSON metadata of a block file (``prepare_file`` adds the checksum)."""
    if len(payload.layers) != len(families):
        raise ValueError(f"payload has {len(payload.layers)} layers, model has {len(families)}")
    checkpoint = payload.checkpoint
    layers = [
        {
            "slice": piece is not None,
            "checkpoint": None
            if checkpoint is None or checkpoint[i] is None
            else len(checkpoint[i].arrays),
        }
        for i, piece in enumerate(payload.layers)
    ]
    kv_dtype = next((str(p.keys.dtype) for p in payload.layers if p is not None), None)
    return {
        "format": KV_BLOCK_FORMAT,
        "file_version": FILE_FORMAT_VERSION,
        "cache_version": CACHE_FORMAT_VERSION,
        "fingerprint": fingerprint,
        "block_hash": meta.block_hash.hex(),
        "parent": meta.parent.hex(),
        "tokens": list(meta.tokens),
        "extra": extra_to_json(meta.extra),
        "partial": meta.partial,
        "checkpointed": checkpoint is not None,
        "namespace": meta.namespace,
        "owners": sorted(meta.owners),
        "families": list(families),
        "layers": layers,
        "kv_dtype": kv_dtype,
        "nbytes": payload.nbytes,
        "stored_at": meta.stored_at,
    }


def decode_block_meta(
    parsed: ParsedFile, fingerprint: str, families: Sequence[str]
) -> BlockMeta:
    """A verified file's block identity, checked against its layer table (no arrays built).

    Raises:
        CorruptFileError: Wrong record kind, version, model or layer layout; tensors the layer
            table does not describe; identity fields that do not hash to the stored block hash.
    """
    m = parsed.metadata
    try:
        if m["format"] != KV_BLOCK_FORMAT or m["file_version"] != FILE_FORMAT_VERSION:
            raise ValueError(f"record {m['format']!r} v{m['file_version']}")
        if m["cache_version"] != CACHE_FORMAT_VERSION or m["fingerprint"] != fingerprint:
            raise ValueError(f"cache v{m['cache_version']} of model {m['fingerprint']!r}")
        if list(m["families"]) != list(families) or len(m["layers"]) != len(families):
            raise ValueError(f"layer families {m['families']} != {list(families)}")
        meta = BlockMeta(
            block_hash=BlockHash(bytes.fromhex(m["block_hash"])),
            parent=BlockHash(bytes.fromhex(m["parent"])),
            tokens=tuple(int(t) for t in m["tokens"]),
            extra=extra_from_json(m["extra"]),
            partial=bool(m["partial"]),
            checkpointed=bool(m["checkpointed"]),
            namespace=str(m["namespace"]),
            owners=tuple(str(o) for o in m["owners"]),
            nbytes=int(m["nbytes"]),
            # Files of format 1 written before retention existed have none: age unknown, 0.
            stored_at=float(m.get("stored_at", 0.0)),
        )
        check_digest(meta.block_hash, "block_hash")
        check_digest(meta.parent, "parent")
        if hash_block(meta.parent, meta.tokens, meta.extra) != meta.block_hash:
            raise ValueError("identity fields do not hash to block_hash")
        expected = _tensor_names(m["layers"], meta.checkpointed)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptFileError(f"bad block record: {exc}") from None
    if expected != set(parsed.tensors):
        raise CorruptFileError(
            f"tensors {sorted(parsed.tensors)} do not match the layer table ({sorted(expected)})"
        )
    size = sum(len(t.data) for t in parsed.tensors.values())
    if size != meta.nbytes:
        raise CorruptFileError(f"tensors hold {size} bytes, metadata says {meta.nbytes}")
    return meta


def decode_block(
    parsed: ParsedFile, fingerprint: str, families: Sequence[str]
) -> tuple[BlockMeta, BlockPayload]:
    """Rebuild a block from a verified file (engine thread: builds MLX arrays).

    Raises:
        CorruptFileError: As ``decode_block_meta``.
    """
    meta = decode_block_meta(parsed, fingerprint, families)
    layers = parsed.metadata["layers"]
    tensors = parsed.tensors

    def take(name: str) -> mx.array:
        t = tensors[name]
        return to_array(t.dtype, t.shape, t.data)

    slices = tuple(
        LayerSlice(take(f"layer.{i}.keys"), take(f"layer.{i}.values")) if layer["slice"] else None
        for i, layer in enumerate(layers)
    )
    checkpoint = None
    if meta.checkpointed:
        checkpoint = tuple(
            None
            if layer["checkpoint"] is None
            else LayerCheckpoint(tuple(take(f"checkpoint.{i}.{j}") for j in range(layer["checkpoint"])))
            for i, layer in enumerate(layers)
        )
    payload = BlockPayload.build(slices, checkpoint)
    assert payload.nbytes == meta.nbytes, (payload.nbytes, meta.nbytes)
    return meta, payload


def _tensor_names(layers: list[dict[str, Any]], checkpointed: bool) -> set[str]:
    names: set[str] = set()
    for i, layer in enumerate(layers):
        if layer["slice"]:
            names.update((f"layer.{i}.keys", f"layer.{i}.values"))
        count = layer["checkpoint"]
        if count is not None:
            if not checkpointed:
                raise ValueError(f"layer {i} has a checkpoint in a block not flagged checkpointed")
            names.update(f"checkpoint.{i}.{j}" for j in range(int(count)))
    return names
