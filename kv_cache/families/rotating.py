"""RotatingKVCache (sliding-window attention).

The live cache keeps only the last ``max_size`` positions (more right after a multi-token
prefill chunk: ``max_size - 1 + chunk``), stored as a ring once decoding wraps around. Harvest
therefore has to happen while a block's positions are still resident: after every prefill
chunk and at least every ``max_size`` decode steps. A restore at length L needs only the last
``min(L, max_size)`` positions; they are laid out in temporal order with ``offset = L``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kv_cache.families.base import LayerCheckpoint, LayerSlice, concat_pieces


def _temporal(cache: Any, v: mx.array) -> mx.array:
    """The resident positions of ``v`` in temporal order (oldest first)."""
    idx = cache._idx
    if idx == v.shape[2]:
        return v
    if idx < cache.offset:
        keep = cache.keep
        return mx.concatenate(
            [v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2
        )
    return v[..., :idx, :]


class RotatingFamily:
    name = "rotating"
    stores_positions = True
    needs_checkpoint = False

    def harvest(self, cache: Any, start: int, end: int) -> LayerSlice:
        if cache.keep:
            raise TypeError("RotatingKVCache with keep > 0 is not supported")
        keys = _temporal(cache, cache.keys)
        resident = keys.shape[2]
        first = cache.offset - resident
        if start < first or end > cache.offset:
            raise ValueError(
                f"positions [{start}, {end}) are not resident in the sliding window "
                f"(resident [{first}, {cache.offset}))"
            )
        values = _temporal(cache, cache.values)
        a, b = start - first, end - first
        return LayerSlice(mx.contiguous(keys[..., a:b, :]), mx.contiguous(values[..., a:b, :]))

    def checkpoint(self, cache: Any) -> LayerCheckpoint:
        raise TypeError("RotatingKVCache is restored from positions, not checkpoints")

    def window(self, cache: Any) -> int | None:
        return int(cache.max_size)

    def restore(
        self,
        template: Any,
        length: int,
        pieces: Sequence[LayerSlice],
        checkpoint: LayerCheckpoint | None,
    ) -> Any:
        keys, values = concat_pieces(pieces)
        kept = keys.shape[2]
        assert kept == min(length, template.max_size), (kept, length, template.max_size)
        template.keys, template.values = keys, values
        template.offset = length
        template._idx = kept
        return template
