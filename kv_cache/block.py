"""One cached block: a run of tokens, its chain identity and the engine's payload for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kv_cache.hashing import BlockHash, ExtraKey


class Payload(Protocol):
    """What the engine stores per block (per-layer KV slices, recurrent-state checkpoints).

    The cache never looks inside; it only needs the size for the RAM budget.
    """

    @property
    def nbytes(self) -> int:
        """Bytes the payload holds in memory."""
        ...


# eq=False: blocks are identities (they sit in sets and intrusive lists), and a field-wise
# __eq__ would recurse through children and queue links.
@dataclass(slots=True, eq=False)
class Block:
    """A cached block (hot-path record).

    Attributes:
        block_hash: Chained digest identifying the block.
        parent: Digest of the previous block, or the chain's root for block 0.
        tokens: The block's token ids; verified on every hit, so a hash collision can never
            serve another sequence's KV.
        extra: Extra keys (image hash, offset) of the images overlapping the block; verified
            on every hit.
        payload: The engine's opaque payload.
        nbytes: Bytes charged to the RAM budget for the payload.
        is_partial: True for the trailing block of a stored sequence with fewer tokens than
            the block size.
        ref_count: Number of active users; a referenced block is never evicted.
        last_access: Value of the RAM tier's clock at the last use (higher is newer).
        owners: Session ids whose tokens produced this block (for erasure).
        namespace: Storage namespace of the tenant whose chain holds the block (a digest of
            the tenant salt), so a lower tier can file the block under it; None when unknown.
        stored_at: Wall-clock seconds when the block's content was first computed (kept across
            tiers: retention counts from it); None when unknown (a lower tier stamps it then).
        children: Stored children (full and partial) of this block, by hash.
        resident: True while the block is in the pool (reachable by hash).
        prev_free: Previous block in the free queue (intrusive link).
        next_free: Next block in the free queue (intrusive link).
    """

    block_hash: BlockHash
    parent: BlockHash
    tokens: tuple[int, ...]
    extra: tuple[ExtraKey, ...]
    payload: Payload | None = field(repr=False)
    nbytes: int
    is_partial: bool
    ref_count: int = 0
    last_access: int = 0
    owners: set[str] = field(default_factory=set)
    namespace: str | None = None
    stored_at: float | None = None
    children: dict[BlockHash, Block] = field(default_factory=dict, repr=False)
    resident: bool = False
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        """Number of tokens in the block."""
        return len(self.tokens)
