"""Choosing how much of a prefix hit a model can use, and rebuilding its live caches.

A hit offers lengths: the end of every matched full block, and ``full + m`` for each tail
candidate (a stored child block matching ``m`` of the request's next tokens). Attention layers
(KVCache, RotatingKVCache) can restore any of them; recurrent layers (ArraysCache) only a
length where a checkpoint was taken, so hybrids back off to the longest length valid for every
layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kv_cache.families import CacheFamily, LayerSlice
from kv_cache.hashing import BlockHash, ImageSpan, block_extra_keys
from kv_cache.payload import BlockPayload


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """What to restore: ``length`` positions from ``blocks`` (+ ``tail`` cut at ``tail_tokens``)."""

    length: int
    blocks: tuple[Any, ...]  # full Blocks, in order
    tail: Any | None  # a child Block used for its first tail_tokens positions
    tail_tokens: int
    parent: BlockHash  # hash of the last full block used (root when none)

    @property
    def used_blocks(self) -> tuple[Any, ...]:
        return self.blocks + ((self.tail,) if self.tail is not None else ())


def plan_restore(
    hit: Any,
    root: BlockHash,
    block_size: int,
    families: Sequence[CacheFamily],
    max_length: int,
    *,
    children_of: Callable[[BlockHash], Mapping[BlockHash, Any]],
    tokens: np.ndarray,
    spans: Sequence[ImageSpan],
) -> RestorePlan:
    """Pick the longest restorable length of ``hit`` not above ``max_length``.

    Attention-only models take the longest offered length. With recurrent layers only
    checkpointed lengths count: full blocks whose end carries a checkpoint, and partial
    *restore points* (checkpointed partial children, e.g. taken at a message start) at any
    depth of the matched chain, not only below its last block.
    """
    full = list(hit.blocks)
    if not any(f.needs_checkpoint for f in families):
        best = RestorePlan(0, (), None, 0, root)
        if full and len(full) * block_size <= max_length:
            best = RestorePlan(len(full) * block_size, tuple(full), None, 0, full[-1].block_hash)
        parent = full[-1].block_hash if full else root
        for child, matched in hit.tail_candidates:
            length = len(full) * block_size + matched
            if best.length < length <= max_length:
                best = RestorePlan(length, tuple(full), child, matched, parent)
        return best

    for k in range(len(full), -1, -1):
        base = k * block_size
        parent = full[k - 1].block_hash if k else root
        if k == len(full):
            # Children of the last matched block were verified by the lookup.
            points = [c for c, m in hit.tail_candidates if m == c.num_tokens]
        else:
            points = [
                c
                for c in children_of(parent).values()
                if c.is_partial
                and c.tokens == tuple(tokens[base : base + c.num_tokens].tolist())
                and c.extra == block_extra_keys(base, c.num_tokens, spans)
            ]
        points = [
            c for c in points if c.payload.checkpoint is not None and base + c.num_tokens <= max_length
        ]
        if points:
            tail = max(points, key=lambda c: c.num_tokens)
            return RestorePlan(base + tail.num_tokens, tuple(full[:k]), tail, tail.num_tokens, parent)
        if k and full[k - 1].payload.checkpoint is not None and base <= max_length:
            return RestorePlan(base, tuple(full[:k]), None, 0, full[k - 1].block_hash)
    return RestorePlan(0, (), None, 0, root)


def restore_caches(
    plan: RestorePlan, templates: list[Any], families: Sequence[CacheFamily]
) -> tuple[list[Any], tuple[LayerSlice | None, ...] | None]:
    """Rebuild live caches at ``plan.length``.

    Returns the caches and, when the plan ends inside a block, the K/V of that block's used
    positions per layer (the harvester continues the block from them).
    """
    L = plan.length
    payloads: list[BlockPayload] = [b.payload for b in plan.blocks]
    if plan.tail is not None:
        payloads.append(plan.tail.payload)
    # Absolute start of each payload (all blocks are block_size long except a partial tail).
    starts = []
    pos = 0
    for p in payloads:
        starts.append(pos)
        pos += p.length
    last_checkpoint = payloads[-1].checkpoint if payloads else None
    caches: list[Any] = []
    for i, (fam, template) in enumerate(zip(families, templates)):
        if fam.needs_checkpoint:
            assert last_checkpoint is not None and last_checkpoint[i] is not None
            caches.append(fam.restore(template, L, (), last_checkpoint[i]))
            continue
        window = fam.window(template)
        need_from = 0 if window is None else max(0, L - window)
        pieces: list[LayerSlice] = []
        for start, p in zip(starts, payloads):
            s = p.layers[i]
            assert s is not None
            end = start + s.length
            if end <= need_from or start >= L:
                continue
            a, b = max(need_from, start) - start, min(L, end) - start
            if a == 0 and b == s.length:
                pieces.append(s)
            else:
                pieces.append(LayerSlice(s.keys[..., a:b, :], s.values[..., a:b, :]))
        caches.append(fam.restore(template, L, pieces, None))
    seed: tuple[LayerSlice | None, ...] | None = None
    if plan.tail is not None and plan.tail_tokens > 0:
        tail = plan.tail.payload
        seed = tuple(
            None
            if s is None
            else LayerSlice(
                mx.contiguous(s.keys[..., : plan.tail_tokens, :]),
                mx.contiguous(s.values[..., : plan.tail_tokens, :]),
            )
            for s in tail.layers
        )
    return caches, seed
