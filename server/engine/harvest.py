"""Harvesting one request's sequence into cache blocks as it is computed.

```
 positions   0 ........ block_start ....... harvested ....... fed
             | stored   | pending pieces    | in the live     |
             | blocks   | (copied K/V)      | cache only      |
```

``collect`` copies K/V of [harvested, fed) out of the live cache (it must run before the
positions leave a sliding window: after each prefill chunk and at least every ``interval``
decode steps). ``checkpoint`` snapshots recurrent layers at ``fed``. ``flush_full`` turns
pending pieces into full blocks; ``flush_partial`` stores the trailing partial block (end of
prompt, end of generation) so reuse there is token-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kv_cache.families import CacheFamily, LayerCheckpoint, LayerSlice
from kv_cache.hashing import BlockHash, ImageSpan, block_extra_keys, hash_block
from kv_cache.payload import BlockPayload


class Harvester:
    def __init__(
        self,
        *,
        store: Any,
        families: Sequence[CacheFamily],
        block_size: int,
        spans: Sequence[ImageSpan],
        owner: str | None,
        parent: BlockHash,
        block_start: int,
        seed_pieces: Sequence[LayerSlice | None] | None,
        fed: int,
    ) -> None:
        """
        Args:
            store: the prefix cache (``insert_block``).
            families: the family adapter of each layer.
            block_size: tokens per block.
            spans: image spans of the prompt (extra keys of blocks overlapping them).
            owner: session id recorded on stored blocks.
            parent: hash of the block before ``block_start`` (the root for block 0).
            block_start: first position not covered by a stored full block.
            seed_pieces: K/V of [block_start, fed) per layer taken from a reused partial
                block (None when fed == block_start).
            fed: positions already in the live cache.
        """
        assert block_start % block_size == 0 and block_start <= fed
        self._store = store
        self._families = tuple(families)
        self._B = block_size
        self._spans = tuple(spans)
        self._owner = owner
        self._parent = parent
        self._block_start = block_start
        self._harvested = fed
        self._pending: list[list[LayerSlice]] = [[] for _ in families]
        if fed > block_start:
            assert seed_pieces is not None
            for i, piece in enumerate(seed_pieces):
                if piece is not None:
                    self._pending[i].append(piece)
        self._checkpoints: dict[int, tuple[LayerCheckpoint | None, ...]] = {}
        self.stored_blocks = 0
        self._has_recurrent = any(f.needs_checkpoint for f in self._families)

    @property
    def harvested(self) -> int:
        return self._harvested

    def collect(self, caches: Sequence[Any], fed: int) -> None:
        """Copy K/V of [harvested, fed) out of the live caches."""
        if fed <= self._harvested:
            return
        pieces = []
        for i, (fam, cache) in enumerate(zip(self._families, caches)):
            if fam.stores_positions:
                piece = fam.harvest(cache, self._harvested, fed)
                self._pending[i].append(piece)
                pieces.extend((piece.keys, piece.values))
        # Materialize now: a lazy slice would keep the live cache's whole buffer alive (and
        # the buffer is replaced as the cache grows).
        mx.eval(pieces)
        self._harvested = fed

    def checkpoint(self, caches: Sequence[Any], fed: int) -> None:
        """Snapshot recurrent layers at length ``fed`` (no-op for attention-only models)."""
        if not self._has_recurrent:
            return
        checkpoint = tuple(
            fam.checkpoint(cache) if fam.needs_checkpoint else None
            for fam, cache in zip(self._families, caches)
        )
        mx.eval([c.arrays for c in checkpoint if c is not None])
        self._checkpoints[fed] = checkpoint

    def flush_full(self, tokens: Sequence[int]) -> None:
        """Store every complete block of pending positions."""
        while self._harvested >= self._block_start + self._B:
            end = self._block_start + self._B
            layers = self._take(end, consume=True)
            payload = BlockPayload.build(layers, self._checkpoints.pop(end, None))
            block_tokens = tokens[self._block_start : end]
            extra = block_extra_keys(self._block_start, self._B, self._spans)
            block = self._store.insert_block(
                self._parent, block_tokens, extra, payload, self._owner, partial=False
            )
            if block is not None:
                self.stored_blocks += 1
                self._parent = block.block_hash
            else:
                # RAM refused it (handed to a lower tier): the chain goes on under its hash.
                self._parent = hash_block(self._parent, block_tokens, extra)
            self._block_start = end
        # Checkpoints behind the stored blocks can no longer be attached to anything.
        for length in [k for k in self._checkpoints if k <= self._block_start]:
            del self._checkpoints[length]

    def flush_partial(self, tokens: Sequence[int]) -> None:
        """Store [block_start, harvested) as a partial block (after ``flush_full``)."""
        end = self._harvested
        if end <= self._block_start:
            return
        assert end - self._block_start < self._B
        checkpoint = self._checkpoints.get(end)
        if self._has_recurrent and checkpoint is None:
            return  # not restorable for recurrent layers: storing it would only cost RAM
        layers = self._take(end, consume=False)
        payload = BlockPayload.build(layers, checkpoint)
        block = self._store.insert_block(
            self._parent,
            tokens[self._block_start : end],
            block_extra_keys(self._block_start, end - self._block_start, self._spans),
            payload,
            self._owner,
            partial=True,
        )
        self.stored_blocks += 1 if block is not None else 0

    def _take(self, end: int, *, consume: bool) -> tuple[LayerSlice | None, ...]:
        """K/V of [block_start, end) per layer; with ``consume`` drop them from pending."""
        length = end - self._block_start
        out: list[LayerSlice | None] = []
        for i, fam in enumerate(self._families):
            if not fam.stores_positions:
                out.append(None)
                continue
            pieces = self._pending[i]
            keys = mx.concatenate([p.keys for p in pieces], axis=2) if len(pieces) > 1 else pieces[0].keys
            values = mx.concatenate([p.values for p in pieces], axis=2) if len(pieces) > 1 else pieces[0].values
            assert keys.shape[2] >= length, (keys.shape, length)
            out.append(LayerSlice(mx.contiguous(keys[..., :length, :]), mx.contiguous(values[..., :length, :])))
            if consume:
                rest = keys.shape[2] - length
                self._pending[i] = (
                    [LayerSlice(mx.contiguous(keys[..., length:, :]), mx.contiguous(values[..., length:, :]))]
                    if rest
                    else []
                )
        mx.eval([(s.keys, s.values) for s in out if s is not None], [
            (p.keys, p.values) for pending in self._pending for p in pending
        ])
        return tuple(out)
