"""Small builders shared by the kv_cache tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kv_cache.block import Block
from kv_cache.hashing import CACHE_FORMAT_VERSION, BlockHash, ImageSpan, root_hash
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tiers.ram import RamTier

ROOT = root_hash(CACHE_FORMAT_VERSION, "test-model", b"tenant-salt")


@dataclass(frozen=True)
class Blob:
    """A payload: the cache only reads ``nbytes``; ``label`` tells payloads apart."""

    nbytes: int
    label: str = ""


def toks(text: str) -> list[int]:
    """'A B C' -> [65, 66, 67]: one token per space-separated letter."""
    return [ord(word) for word in text.split()]


def make_cache(
    block_size: int = 4,
    budget: int = 1_000_000,
    spilled: list[Block] | None = None,
    ram: RamTier | None = None,
) -> PrefixCache:
    return PrefixCache(
        block_size,
        ram if ram is not None else RamTier(budget),
        on_evict=spilled.append if spilled is not None else None,
    )


def store(
    cache: PrefixCache,
    tokens: Sequence[int],
    *,
    spans: Sequence[ImageSpan] = (),
    nbytes: int = 10,
    partial: bool = True,
    owner: str | None = None,
    root: BlockHash = ROOT,
    label: str = "",
) -> list[Block]:
    """Store a sequence with one ``nbytes`` payload per block (and for the partial tail)."""
    full, rest = divmod(len(tokens), cache.block_size)
    payloads = [Blob(nbytes, f"{label}{index}") for index in range(full)]
    partial_payload = Blob(nbytes, f"{label}p") if partial and rest else None
    return cache.store(root, tokens, spans, payloads, partial_payload, owner)
