"""What one stored block holds for a model: per-layer K/V slices and optional checkpoints.

```
 BlockPayload
   layers[i]      LayerSlice (attention layers: K,V of the block's positions) | None (recurrent)
   checkpoint     None, or per layer LayerCheckpoint (recurrent) | None (attention),
                  the state at the block's *end*
```
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.families.base import LayerCheckpoint, LayerSlice


@dataclass(frozen=True, slots=True)
class BlockPayload:
    layers: tuple[LayerSlice | None, ...]
    checkpoint: tuple[LayerCheckpoint | None, ...] | None
    nbytes: int

    @classmethod
    def build(
        cls,
        layers: tuple[LayerSlice | None, ...],
        checkpoint: tuple[LayerCheckpoint | None, ...] | None,
    ) -> BlockPayload:
        size = sum(s.nbytes for s in layers if s is not None)
        if checkpoint is not None:
            size += sum(c.nbytes for c in checkpoint if c is not None)
        return cls(layers, checkpoint, size)

    @property
    def checkpointed(self) -> bool:
        """A restore point of its own for recurrent layers (see ``PrefixCache``)."""
        return self.checkpoint is not None

    @property
    def length(self) -> int:
        """Positions covered (0 when the model has no attention layer)."""
        for s in self.layers:
            if s is not None:
                return s.length
        return 0
