"""Small builders for the tenancy-lifecycle tests: tenant-filed blocks in a RAM cache, and
feature entries."""

from __future__ import annotations

from kv_cache.block import Block
from kv_cache.prefix_cache import PrefixCache
from kv_cache.tiers.ram import RamTier
from tests.kv_cache.factories import ROOT, Blob
from vision_cache.feature_cache import CachedFeatures, FeatureKey
from vision_cache.hashing import ImageHash

BLOCK = 4
NS_A = "aaaaaaaaaaaaaaaa"
NS_B = "bbbbbbbbbbbbbbbb"
NS_C = "cccccccccccccccc"


class Clock:
    """A settable wall clock (seconds)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def cache(budget: int, spilled: list[Block] | None = None, clock: Clock | None = None) -> PrefixCache:
    return PrefixCache(
        BLOCK, RamTier(budget), on_evict=spilled.append if spilled is not None else None,
        clock=clock if clock is not None else Clock(),
    )


def put(c: PrefixCache, namespace: str | None, label: str, *, first: int, nbytes: int = 10,
        owner: str | None = None) -> Block:
    """One full block of tokens ``first .. first+3`` under the root, labelled ``label``."""
    block = c.insert_block(ROOT, list(range(first, first + BLOCK)), (), Blob(nbytes, label), owner,
                           partial=False, namespace=namespace)
    assert block is not None
    return block


def labels(blocks) -> list[str]:
    return [block.payload.label for block in blocks]


def feature_key(i: int) -> FeatureKey:
    return FeatureKey(ImageHash(bytes([i]) * 16), "model-fp")


def features(nbytes: int) -> CachedFeatures:
    return CachedFeatures(features=None, meta={}, nbytes=nbytes)
