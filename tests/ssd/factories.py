"""Small builders shared by the SSD tier tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx

from kv_cache.block import Block
from kv_cache.families.base import LayerCheckpoint, LayerSlice
from kv_cache.hashing import CACHE_FORMAT_VERSION, BlockHash, ExtraKey, hash_block, root_hash
from kv_cache.payload import BlockPayload
from kv_cache.tiers.ssd import SsdTier
from kv_cache.tiers.ssd_index import RecordKind
from server.engine.prompt import ReplyLedger
from server.engine.runner import ModelRunner
from server.engine.settings import EngineSettings
from tests.engine.conftest import BLOCK, CHUNK, loaded

FINGERPRINT = "0123456789abcdef-test-model"
FAMILIES = ("kv", "arrays")
NAMESPACE = "ns0123456789abcd"
ROOT = root_hash(CACHE_FORMAT_VERSION, FINGERPRINT, b"tenant-salt")
# Wall-clock seconds of the factories' blocks (``stored_at``): seed s is stored at STORED_AT + s.
STORED_AT = 1_700_000_000.0


def payload(seed: int, length: int = 4, *, checkpoint: bool = False, dtype: mx.Dtype = mx.float32) -> BlockPayload:
    """A payload for a two-layer model (an attention layer, a recurrent layer), from a seed."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    keys = mx.random.normal((1, 2, length, 8), key=k1).astype(dtype)
    values = mx.random.normal((1, 2, length, 8), key=k2).astype(dtype)
    ckpt = None
    if checkpoint:
        state = mx.random.normal((1, 3, 16), key=k3).astype(dtype)
        ckpt = (None, LayerCheckpoint((state, mx.arange(5, dtype=mx.int32) + seed)))
    p = BlockPayload.build((LayerSlice(keys, values), None), ckpt)
    mx.eval([a for a in (keys, values) if a is not None], [c.arrays for c in ckpt or () if c is not None])
    return p


def block(
    parent: BlockHash,
    tokens: Sequence[int],
    seed: int,
    *,
    extra: tuple[ExtraKey, ...] = (),
    partial: bool = False,
    checkpoint: bool = False,
    namespace: str | None = NAMESPACE,
    owners: Sequence[str] = ("s1",),
) -> Block:
    """A block (not in any pool) with a deterministic payload."""
    p = payload(seed, len(tokens), checkpoint=checkpoint)
    b = Block(
        hash_block(parent, tokens, extra), parent, tuple(tokens), extra, p, p.nbytes, partial,
        namespace=namespace, stored_at=STORED_AT + seed,
    )
    b.owners.update(owners)
    return b


def chain(count: int, *, size: int = 4, start_seed: int = 0, parent: BlockHash = ROOT) -> list[Block]:
    """``count`` consecutive full blocks of tokens 0, 1, 2, ..."""
    blocks = []
    for i in range(count):
        b = block(parent, list(range(i * size, (i + 1) * size)), start_seed + i)
        blocks.append(b)
        parent = b.block_hash
    return blocks


def open_tier(cache_dir: Path, **kwargs: object) -> SsdTier:
    return SsdTier(cache_dir, FINGERPRINT, FAMILIES, **kwargs)  # type: ignore[arg-type]


def same_payload(a: BlockPayload, b: BlockPayload) -> bool:
    """Bitwise equality of two payloads, dtypes included."""
    def arrays(p: BlockPayload) -> list[mx.array]:
        out = [x for s in p.layers if s is not None for x in (s.keys, s.values)]
        out += [x for c in p.checkpoint or () if c is not None for x in c.arrays]
        return out

    xs, ys = arrays(a), arrays(b)
    return (
        a.nbytes == b.nbytes
        and len(xs) == len(ys)
        and all(x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(xs, ys))
    )


def block_files(cache_dir: Path) -> list[Path]:
    """Every stored KV block file, sorted."""
    return sorted(p for p in (cache_dir / RecordKind.KV.value).rglob("*.safetensors"))


def temp_files(cache_dir: Path) -> list[str]:
    return sorted(
        os.path.join(d, f) for d, _, files in os.walk(cache_dir) for f in files if f.endswith(".tmp")
    )


def make_runner(
    family: str,
    cache_dir: Path | None,
    *,
    ram_budget_bytes: int = 256 << 20,
    ledger: ReplyLedger | None = None,
    queue_size: int = 4096,
    ssd_budget_bytes: int = 1 << 30,
    clock: Callable[[], float] | None = None,
) -> ModelRunner:
    """A runner on the tiny fixture; ``cache_dir`` None means RAM only (a cold reference)."""
    settings = EngineSettings(
        model_path=Path("unused"),
        cache_dir=cache_dir if cache_dir is not None else Path("unused"),
        block_size=BLOCK,
        prefill_chunk=CHUNK,
        ram_budget_bytes=ram_budget_bytes,
        ssd_enabled=cache_dir is not None,
        ssd_budget_bytes=ssd_budget_bytes,
        ssd_queue_size=queue_size,
    )
    if clock is None:
        return ModelRunner(loaded(family), settings, ledger=ledger)
    return ModelRunner(loaded(family), settings, ledger=ledger, clock=clock)
