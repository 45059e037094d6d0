"""KVCache: every position's K/V is kept; restorable at any length (it trims)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kv_cache.families.base import LayerCheckpoint, LayerSlice, concat_pieces


class KVFamily:
    name = "kv"
    stores_positions = True
    needs_checkpoint = False

    def harvest(self, cache: Any, start: int, end: int) -> LayerSlice:
        assert 0 <= start < end <= cache.offset, (start, end, cache.offset)
        keys = mx.contiguous(cache.keys[..., start:end, :])
        values = mx.contiguous(cache.values[..., start:end, :])
        return LayerSlice(keys, values)

    def checkpoint(self, cache: Any) -> LayerCheckpoint:
        raise TypeError("KVCache is restored from positions, not checkpoints")

    def window(self, cache: Any) -> int | None:
        return None

    def restore(
        self,
        template: Any,
        length: int,
        pieces: Sequence[LayerSlice],
        checkpoint: LayerCheckpoint | None,
    ) -> Any:
        keys, values = concat_pieces(pieces)
        assert keys.shape[2] == length, (keys.shape, length)
        template.keys, template.values = keys, values
        template.offset = length
        return template
