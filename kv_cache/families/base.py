"""The cache-family protocol and its registry keyed by cache class."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from kv_cache.sizing import array_nbytes


@dataclass(frozen=True, slots=True)
class LayerSlice:
    """K and V of one attention layer for a run of consecutive positions.

    Arrays are (batch=1, kv_heads, positions, head_dim) and own their memory (copied out of
    the live cache, so a stored block never pins a request's whole KV buffer).
    """

    keys: mx.array
    values: mx.array

    @property
    def length(self) -> int:
        return int(self.keys.shape[2])

    @property
    def nbytes(self) -> int:
        return array_nbytes(self.keys) + array_nbytes(self.values)


@dataclass(frozen=True, slots=True)
class LayerCheckpoint:
    """The complete recurrent state of one layer at one sequence length."""

    arrays: tuple[mx.array, ...]

    @property
    def nbytes(self) -> int:
        return sum(array_nbytes(a) for a in self.arrays)


class CacheFamily(Protocol):
    """How one mlx cache class is harvested and rebuilt."""

    name: str
    # True when the family keeps per-position K/V (harvested into every block).
    stores_positions: bool
    # True when restoring at length L needs a checkpoint taken exactly at L.
    needs_checkpoint: bool

    def harvest(self, cache: Any, start: int, end: int) -> LayerSlice:
        """Copy the K/V of absolute positions [start, end) out of a live cache."""
        ...

    def checkpoint(self, cache: Any) -> LayerCheckpoint:
        """Copy the state of a live cache at its current length."""
        ...

    def window(self, cache: Any) -> int | None:
        """Positions a restore needs (None: all of them)."""
        ...

    def restore(
        self,
        template: Any,
        length: int,
        pieces: Sequence[LayerSlice],
        checkpoint: LayerCheckpoint | None,
    ) -> Any:
        """Build a live cache of ``length`` positions.

        Args:
            template: a fresh cache of this family from the model (carries window sizes).
            length: the sequence length the cache must represent.
            pieces: consecutive slices covering exactly the positions the family needs
                (``[length - window, length)`` or ``[0, length)``); empty for checkpoint families.
            checkpoint: the state at ``length`` for checkpoint families, else None.
        """
        ...


def concat_pieces(pieces: Sequence[LayerSlice]) -> tuple[mx.array, mx.array]:
    """Concatenate consecutive slices along the position axis into *new* array objects.

    Live caches assign into their buffers in place (``keys[..., i:j, :] = k``); handing them a
    stored block's own array object would let that write reach the stored block.
    """
    if not pieces:
        raise ValueError("concat_pieces needs at least one slice")
    if len(pieces) == 1:
        return mx.contiguous(pieces[0].keys), mx.contiguous(pieces[0].values)
    keys = mx.concatenate([p.keys for p in pieces], axis=2)
    values = mx.concatenate([p.values for p in pieces], axis=2)
    return keys, values


def family_registry() -> Mapping[type, CacheFamily]:
    """Map each supported mlx cache class to its family adapter."""
    from mlx_vlm.models import cache as vlm_cache

    from kv_cache.families.arrays import ArraysFamily
    from kv_cache.families.kv import KVFamily
    from kv_cache.families.rotating import RotatingFamily

    registry: dict[type, CacheFamily] = {
        vlm_cache.KVCache: KVFamily(),
        vlm_cache.RotatingKVCache: RotatingFamily(),
        vlm_cache.ArraysCache: ArraysFamily(),
    }
    return registry


class UnsupportedCacheError(TypeError):
    """The model uses a cache class no family adapter handles."""


def family_for(cache: Any, registry: Mapping[type, CacheFamily]) -> CacheFamily:
    """Return the adapter for a live cache object (exact class match)."""
    try:
        return registry[type(cache)]
    except KeyError:
        supported = ", ".join(sorted(c.__name__ for c in registry))
        raise UnsupportedCacheError(
            f"cache class {type(cache).__name__} is not supported (supported: {supported})"
        ) from None
