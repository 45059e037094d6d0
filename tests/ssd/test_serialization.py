"""Block files: round trips in every dtype, interoperability, and every kind of damage caught."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import safetensors.numpy
import xxhash

from kv_cache.serialization import (
    BlockMeta,
    CorruptFileError,
    block_metadata,
    block_tensors,
    decode_block,
    decode_block_meta,
    host_tensor,
    parse_file,
    prepare_file,
    to_array,
)
from tests.ssd.factories import FAMILIES, FINGERPRINT, NAMESPACE, ROOT, block, same_payload


def file_bytes(b, fingerprint: str = FINGERPRINT) -> bytes:
    meta = BlockMeta(
        b.block_hash, b.parent, b.tokens, b.extra, b.is_partial,
        b.payload.checkpoint is not None, NAMESPACE, tuple(sorted(b.owners)), b.payload.nbytes,
    )
    prepared = prepare_file(block_tensors(b.payload), block_metadata(meta, b.payload, fingerprint, FAMILIES))
    return b"".join(bytes(chunk) for chunk in prepared.chunks())


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_block_round_trip_is_bitwise(dtype: mx.Dtype) -> None:
    extra = ((b"\x07" * 16, -3), (b"\x09" * 16, 2))
    original = block(ROOT, [5, 6, 7], 11, extra=extra, partial=True, checkpoint=True)
    original.payload = _cast(original.payload, dtype)
    meta, restored = decode_block(parse_file(file_bytes(original)), FINGERPRINT, FAMILIES)
    assert meta == BlockMeta(
        original.block_hash, ROOT, (5, 6, 7), extra, True, True, NAMESPACE, ("s1",),
        original.payload.nbytes,
    )
    assert same_payload(restored, original.payload)
    assert restored.layers[0].keys.dtype == dtype
    assert restored.checkpoint[1].arrays[1].dtype == mx.int32


def _cast(p, dtype):
    from kv_cache.families.base import LayerCheckpoint, LayerSlice
    from kv_cache.payload import BlockPayload

    s = p.layers[0]
    ckpt = p.checkpoint[1].arrays
    cast = BlockPayload.build(
        (LayerSlice(s.keys.astype(dtype), s.values.astype(dtype)), None),
        (None, LayerCheckpoint((ckpt[0].astype(dtype), ckpt[1]))),
    )
    mx.eval(cast.layers[0].keys, cast.layers[0].values, cast.checkpoint[1].arrays)
    return cast


def test_files_are_plain_safetensors(tmp_path: Path) -> None:
    b = block(ROOT, [1, 2, 3, 4], 3)
    path = tmp_path / "b.safetensors"
    path.write_bytes(file_bytes(b))
    loaded_np = safetensors.numpy.load_file(str(path))
    assert sorted(loaded_np) == ["layer.0.keys", "layer.0.values"]
    np.testing.assert_array_equal(loaded_np["layer.0.keys"], np.asarray(b.payload.layers[0].keys))
    loaded_mx, metadata = mx.load(str(path), return_metadata=True)
    assert mx.array_equal(loaded_mx["layer.0.values"], b.payload.layers[0].values).item()
    meta = json.loads(metadata["vlmcache"])
    assert meta["block_hash"] == b.block_hash.hex()
    assert meta["tokens"] == [1, 2, 3, 4]
    assert meta["families"] == list(FAMILIES)
    assert meta["kv_dtype"] == "mlx.core.float32"
    # The checksum is the xxh3_128 of the tensor bytes in file order.
    keys = np.asarray(b.payload.layers[0].keys).tobytes()
    values = np.asarray(b.payload.layers[0].values).tobytes()
    assert meta["checksum"] == xxhash.xxh3_128_hexdigest(keys + values)


def test_bf16_bytes_travel_unchanged() -> None:
    array = mx.array([1.5, -2.25, 3.0e-3, 65504.0], dtype=mx.float32).astype(mx.bfloat16)
    tensor = host_tensor("x", array)
    assert tensor.dtype == "BF16" and tensor.nbytes == 8
    back = to_array("BF16", (4,), memoryview(tensor.data))
    assert back.dtype == mx.bfloat16
    assert mx.array_equal(back.view(mx.uint16), array.view(mx.uint16)).item()


def _header_len(data: bytes) -> int:
    return struct.unpack_from("<Q", data)[0]


def test_flipped_tensor_byte_is_a_checksum_mismatch() -> None:
    data = bytearray(file_bytes(block(ROOT, [1, 2, 3, 4], 3)))
    data[len(data) - 5] ^= 0x01
    with pytest.raises(CorruptFileError, match="checksum mismatch"):
        parse_file(data)


@pytest.mark.parametrize("cut", [0, 5, 100, -1])
def test_truncated_file_is_corrupt(cut: int) -> None:
    data = file_bytes(block(ROOT, [1, 2, 3, 4], 3))
    with pytest.raises(CorruptFileError):
        parse_file(data[:cut])


def test_replaced_header_is_corrupt() -> None:
    data = file_bytes(block(ROOT, [1, 2, 3, 4], 3))
    n = _header_len(data)
    garbage = b"{" + b"x" * (n - 1)
    with pytest.raises(CorruptFileError, match="unreadable header"):
        parse_file(data[:8] + garbage + data[8 + n :])
    with pytest.raises(CorruptFileError, match="header length"):
        parse_file(struct.pack("<Q", 2**40) + data[8:])


def test_edited_token_in_metadata_breaks_the_identity() -> None:
    b = block(ROOT, [1, 2, 3, 4], 3)
    data = file_bytes(b)
    # Same length edit inside the JSON: token 3 -> 9; the checksum covers tensors only.
    forged = data.replace(b"[1,2,3,4]", b"[1,2,9,4]")
    assert forged != data
    with pytest.raises(CorruptFileError, match="do not hash to block_hash"):
        decode_block_meta(parse_file(forged), FINGERPRINT, FAMILIES)


def test_other_model_or_layout_is_rejected() -> None:
    data = file_bytes(block(ROOT, [1, 2, 3, 4], 3), fingerprint="another-model")
    with pytest.raises(CorruptFileError, match="another-model"):
        decode_block_meta(parse_file(data), FINGERPRINT, FAMILIES)
    good = file_bytes(block(ROOT, [1, 2, 3, 4], 3))
    with pytest.raises(CorruptFileError, match="families"):
        decode_block_meta(parse_file(good), FINGERPRINT, ("kv", "kv"))


def test_tensor_table_must_cover_the_body_exactly() -> None:
    data = file_bytes(block(ROOT, [1, 2, 3, 4], 3))
    with pytest.raises(CorruptFileError, match="file body"):
        parse_file(data + b"\0" * 8)
