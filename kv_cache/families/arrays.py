"""ArraysCache (SSM / linear-attention state): no positions, no trim.

The state at length L summarises every token before L, so it can only be restored from a
checkpoint taken exactly at L. Checkpoints are large (the whole recurrent state of the layer),
so the engine takes them only at chunk boundaries, the end of the prompt and the end of
generation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kv_cache.families.base import LayerCheckpoint, LayerSlice


class ArraysFamily:
    name = "arrays"
    stores_positions = False
    needs_checkpoint = True

    def harvest(self, cache: Any, start: int, end: int) -> LayerSlice:
        raise TypeError("ArraysCache keeps no per-position state")

    def checkpoint(self, cache: Any) -> LayerCheckpoint:
        state = cache.state
        if any(a is None for a in state):
            raise ValueError("ArraysCache checkpoint requested before any token was processed")
        # Copies: the live arrays are replaced (not mutated) by later steps, but a copy keeps
        # the checkpoint's memory independent of the request's graph.
        return LayerCheckpoint(tuple(mx.contiguous(a) for a in state))

    def window(self, cache: Any) -> int | None:
        return 0

    def restore(
        self,
        template: Any,
        length: int,
        pieces: Sequence[LayerSlice],
        checkpoint: LayerCheckpoint | None,
    ) -> Any:
        if checkpoint is None:
            raise ValueError(f"ArraysCache cannot be restored at length {length} without a checkpoint")
        # New array objects: the live cache must never alias the stored checkpoint.
        template.state = [mx.contiguous(a) for a in checkpoint.arrays]
        return template
