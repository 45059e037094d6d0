"""Prefix cache: lookup and store of block chains in RAM, within a ``RamTier`` budget.

Matching. ``lookup`` walks the request's chain of full blocks while each block is resident and
its stored tokens and extra keys equal the request's (a hash hit alone is never trusted). Then
it matches the tail at token granularity: the longest common prefix of the request's next
tokens with every stored child (full or partial) of the last matched block (or of the root),
restricted to where the image keys agree. That covers exact, prefix, supersequence and
longest-common-prefix matches; the engine picks the candidate its cache family can restore.

At least one prompt token is always left to compute (its logits start decoding): the walk only
takes full blocks ending at or before ``len(tokens) - 1``, and the tail is capped to the same
bound. A fully cached final block therefore appears as a tail candidate with ``B - 1`` tokens.

Eviction. LRU over unreferenced blocks, any depth, under the RAM tier's quota rule (a tenant
over its quota gives back its own oldest blocks; room under the budget comes from the requester
and the tenants above their guarantee: ``kv_cache.tiers.quota``); without quotas, strict LRU. ``touch``, ``release`` and ``store``
stamp a chain deepest block first, a block inserted under an unreferenced parent is queued just
before it, and every use of a block also uses its ancestors, so a parent is never older than
its children and leaves go first. If a parent does go first (its
children were pinned), its children stay resident, detached: a RAM-only walk cannot reach them
and they age out, but a lower tier that hands the parent back re-attaches them.

Partial blocks. The trailing ``< B`` tokens of a stored sequence are kept as a partial child of
the last full block. A new full block or longer partial that covers a stored partial (same
leading tokens, same image keys there) supersedes it: the partial is dropped and its bytes
freed (a referenced one when released), without going to ``on_evict`` since the covering block
holds the same positions. Exception: a partial whose payload is ``checkpointed`` (it carries
recurrent state taken at exactly its end) is a restore point of its own; it is neither
superseded nor refused as covered. Storing a partial that an existing child already covers stores
nothing and returns that child.

Spilling. ``on_evict(block)`` is called exactly once for each block leaving RAM by eviction,
and for each new block RAM refuses (referenced blocks fill the budget), so a lower tier can
take it; it is not called for superseded, discarded (erased) or expired blocks.

Retention. Every block records ``stored_at`` (wall clock of its first computation, kept when a
lower tier hands it back), so time to live counts from when the content was made, never from
its last use; ``expire`` drops a block for that reason (``kv_cache.retention``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from kv_cache.block import Block, Payload
from kv_cache.block_pool import BlockPool
from kv_cache.hashing import (
    BlockHash,
    ChainHasher,
    ExtraKey,
    ImageSpan,
    block_extra_keys,
    check_digest,
    encode_extra,
    hash_block_bytes,
    token_array,
)
from kv_cache.matching import checkpointed, keys_before, tail_match
from kv_cache.tiers.ram import RamTier

__all__ = ["DEFAULT_BLOCK_SIZE", "PrefixCache", "PrefixCacheStats", "PrefixHit", "tail_match"]

# Tokens per block unless configured otherwise.
DEFAULT_BLOCK_SIZE = 64


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Result of a lookup.

    Attributes:
        blocks: Matched full blocks, in chain order from block 0.
        tail_candidates: ``(child, matched_tokens)`` for stored children of the last matched
            block (or the root) sharing ``matched_tokens > 0`` leading tokens with the
            request's next tokens, most tokens first.
        hit_tokens: ``len(blocks) * block_size`` plus the best tail; always less than the
            number of prompt tokens.
    """

    blocks: tuple[Block, ...]
    tail_candidates: tuple[tuple[Block, int], ...]
    hit_tokens: int

    @property
    def tail_tokens(self) -> int:
        """Tokens of the best tail candidate (0 without one)."""
        return self.tail_candidates[0][1] if self.tail_candidates else 0


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters of one prefix cache.

    Attributes:
        lookups: Calls to ``lookup``.
        hit_blocks: Full blocks matched over all lookups.
        hit_tokens: Tokens matched (full blocks plus best tails) over all lookups.
        inserts: New blocks admitted to RAM.
        already_present: Inserts of a block that was already resident (touched instead).
        covered_partials: Partial inserts skipped because a stored child covers them.
        superseded_partials: Stored partials dropped because a covering block was stored.
        rejected: New blocks RAM refused (spilled to ``on_evict`` instead).
        collisions: Inserts whose hash was taken by a block with other tokens or keys.
        evictions: Blocks evicted for room.
        evicted_bytes: Bytes of those blocks.
        discarded: Blocks dropped by ``discard``.
        expired: Blocks dropped by ``expire`` (time to live over).
    """

    lookups: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    inserts: int = 0
    already_present: int = 0
    covered_partials: int = 0
    superseded_partials: int = 0
    rejected: int = 0
    collisions: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    discarded: int = 0
    expired: int = 0


class PrefixCache:
    """Block chains of prompts (and generations) in RAM.

    Args:
        block_size: Tokens per full block.
        ram: RAM budget to charge; the cache registers itself as an evictor.
        on_evict: Receives each block that leaves (or is refused by) RAM, once.
        clock: Wall-clock seconds stamped on new blocks as ``stored_at`` (injectable for tests).
    """

    __slots__ = ("_block_size", "_ram", "_on_evict", "_pool", "_resident_bytes", "stats",
                 "_eviction_listeners", "_clock", "_usage")

    def __init__(
        self,
        block_size: int,
        ram: RamTier,
        on_evict: Callable[[Block], None] | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self._ram = ram
        self._on_evict = on_evict
        self._pool = BlockPool(clock=self._ram.tick)
        self._resident_bytes = 0
        self._usage: dict[str | None, int] = {}
        self._clock = clock
        self.stats = PrefixCacheStats()
        self._eviction_listeners: list[Callable[[Block], None]] = []
        self._ram.register(self)

    @property
    def block_size(self) -> int:
        """Tokens per full block."""
        return self._block_size

    @property
    def ram(self) -> RamTier:
        """The RAM budget this cache charges."""
        return self._ram

    @property
    def pool(self) -> BlockPool:
        """The resident blocks (read access: get, children_of, free_blocks, iteration)."""
        return self._pool

    @property
    def resident_bytes(self) -> int:
        """Bytes of this cache's resident blocks."""
        return self._resident_bytes

    @property
    def clock(self) -> Callable[[], float]:
        """The wall clock of ``stored_at`` stamps."""
        return self._clock

    def __len__(self) -> int:
        return len(self._pool)

    # -- lookup -------------------------------------------------------------------------------

    def lookup(
        self,
        root: BlockHash,
        tokens: Sequence[int] | np.ndarray,
        spans: Sequence[ImageSpan] = (),
    ) -> PrefixHit:
        """Longest cached prefix of a prompt; changes neither LRU order nor references.

        Args:
            root: Root digest of the (format, model, tenant).
            tokens: The prompt's token ids.
            spans: Image placeholder spans of the prompt.

        Returns:
            The matched blocks and tail candidates; ``hit_tokens < len(tokens)``.
        """
        check_digest(root, "root")
        array = token_array(tokens)
        ids = tuple(tokens) if isinstance(tokens, (list, tuple)) else tuple(array.tolist())
        size = self._block_size
        limit = len(ids) - 1
        hasher = ChainHasher(root, array.tobytes(), spans, size)
        pool = self._pool
        matched: list[Block] = []
        parent = root
        start = 0
        while start + size <= limit:
            digest = hasher.next_hash()
            block = pool.get(digest)
            if (
                block is None
                or block.is_partial
                or block.parent != parent
                or block.extra != hasher.extra(len(matched))
                or block.tokens != ids[start : start + size]
            ):
                break
            matched.append(block)
            parent = digest
            start += size
        tail = self._tail_candidates(parent, ids, start, limit - start, spans)
        hit = PrefixHit(tuple(matched), tail, start + (tail[0][1] if tail else 0))
        self.stats.lookups += 1
        self.stats.hit_blocks += len(matched)
        self.stats.hit_tokens += hit.hit_tokens
        return hit

    def _tail_candidates(
        self,
        parent: BlockHash,
        ids: tuple[int, ...],
        start: int,
        cap: int,
        spans: Sequence[ImageSpan],
    ) -> tuple[tuple[Block, int], ...]:
        if cap <= 0:
            return ()
        children = self._pool.children_of(parent)
        if not children:
            return ()
        window = ids[start : start + self._block_size]
        window_extra = block_extra_keys(start, len(window), spans) if spans else ()
        found = []
        for child in children.values():
            matched = tail_match(child.tokens, child.extra, window, window_extra, cap)
            if matched:
                found.append((child, matched))
        # Deterministic order: most tokens, then full before partial, then by hash.
        found.sort(key=lambda item: (-item[1], item[0].is_partial, item[0].block_hash))
        return tuple(found)

    # -- use ----------------------------------------------------------------------------------

    def acquire(self, blocks: Sequence[Block]) -> None:
        """Pin resident blocks while a request uses them (never evicted while pinned).

        Raises:
            ValueError: A block is no longer resident (nothing is pinned then).
        """
        for block in blocks:
            if not block.resident:
                raise ValueError(f"cannot acquire non-resident block {block.block_hash.hex()}")
        for block in blocks:
            self._pool.acquire(block)

    def release(self, blocks: Sequence[Block]) -> None:
        """Unpin blocks (in chain order); unpinned blocks become the most recently used."""
        for block in reversed(blocks):
            if self._pool.release(block) and not block.resident:
                # Superseded or discarded while in use: its bytes go now.
                self._ram.discharge(block.nbytes)

    def touch(self, blocks: Sequence[Block]) -> None:
        """Mark blocks (in chain order) as just used; non-resident ones are skipped."""
        for block in reversed(blocks):
            if block.resident:
                self._pool.touch(block)

    # -- store --------------------------------------------------------------------------------

    def insert_block(
        self,
        parent: BlockHash,
        tokens: Sequence[int] | np.ndarray,
        extra: tuple[ExtraKey, ...],
        payload: Payload | None,
        owner: str | None = None,
        *,
        partial: bool,
        namespace: str | None = None,
        stored_at: float | None = None,
    ) -> Block | None:
        """Store one block under ``parent`` (as the engine harvests it).

        Args:
            parent: Digest of the previous block or the root.
            tokens: The block's tokens: exactly ``block_size``, or fewer when ``partial``.
            extra: The block's extra keys (``block_extra_keys`` with the block's own length).
            payload: The engine's payload; may be None only if the block turns out present.
            owner: Session id that produced the block.
            partial: Whether this is a trailing partial block.
            namespace: Tenant storage namespace recorded on a new block (lower tiers file
                the block under it); its RAM quota applies.
            stored_at: When the content was first computed (a block promoted from a lower
                tier keeps its age); None: now.

        Returns:
            The resident block: the new one; the one already stored with this hash (touched,
            gaining ``owner``); or, for a partial, an existing child covering it (touched,
            *not* gaining ``owner``: it also holds tokens that session did not produce).
            None when nothing was stored: RAM refused it (it went to ``on_evict``) or the hash
            belongs to a block with other tokens.
        """
        check_digest(parent, "parent")
        array = token_array(tokens)
        count = len(array)
        if partial and not 0 < count < self._block_size:
            raise ValueError(f"partial block needs 1..{self._block_size - 1} tokens, got {count}")
        if not partial and count != self._block_size:
            raise ValueError(f"full block needs {self._block_size} tokens, got {count}")
        digest = hash_block_bytes(parent, array.tobytes(), count, encode_extra(extra))
        return self._insert(
            parent, digest, tuple(array.tolist()), tuple(extra), payload, owner, partial, namespace,
            stored_at,
        )

    def store(
        self,
        root: BlockHash,
        tokens: Sequence[int] | np.ndarray,
        spans: Sequence[ImageSpan],
        payloads: Sequence[Payload | None],
        partial_payload: Payload | None = None,
        owner: str | None = None,
        namespace: str | None = None,
    ) -> list[Block]:
        """Store a whole sequence: its full blocks and, with ``partial_payload``, its tail.

        Args:
            root: Root digest of the (format, model, tenant).
            tokens: The sequence's token ids.
            spans: Its image placeholder spans.
            payloads: One per full block; None allowed for blocks already resident.
            partial_payload: Payload of the trailing ``len(tokens) % block_size`` tokens.
            owner: Session id that produced the sequence.
            namespace: Tenant storage namespace recorded on new blocks.

        Returns:
            The blocks resident after the call, in chain order (see ``insert_block`` for
            what is returned for a present or covered block; refused blocks are left out).
        """
        check_digest(root, "root")
        array = token_array(tokens)
        ids = tuple(array.tolist())
        size = self._block_size
        full, rest = divmod(len(ids), size)
        if len(payloads) != full:
            raise ValueError(
                f"{len(ids)} tokens make {full} full blocks, got {len(payloads)} payloads"
            )
        if partial_payload is not None and rest == 0:
            raise ValueError(f"partial_payload given but {len(ids)} tokens leave no partial block")
        token_bytes = array.tobytes()
        hasher = ChainHasher(root, token_bytes, spans, size)
        parent = root
        stored: list[Block] = []
        for index in range(full):
            digest = hasher.next_hash()
            block = self._insert(
                parent,
                digest,
                ids[index * size : (index + 1) * size],
                hasher.extra(index),
                payloads[index],
                owner,
                False,
                namespace,
            )
            if block is not None:
                stored.append(block)
            parent = digest
        if partial_payload is not None:
            start = full * size
            extra = block_extra_keys(start, rest, spans)
            digest = hash_block_bytes(parent, token_bytes[start * 4 :], rest, encode_extra(extra))
            block = self._insert(
                parent, digest, ids[start:], extra, partial_payload, owner, True, namespace
            )
            if block is not None:
                stored.append(block)
        stored = [block for block in stored if block.resident]
        self.touch(stored)
        return stored

    def _insert(
        self,
        parent: BlockHash,
        digest: BlockHash,
        tokens: tuple[int, ...],
        extra: tuple[ExtraKey, ...],
        payload: Payload | None,
        owner: str | None,
        partial: bool,
        namespace: str | None = None,
        stored_at: float | None = None,
    ) -> Block | None:
        pool = self._pool
        existing = pool.get(digest)
        if existing is not None:
            if (
                existing.parent != parent
                or existing.tokens != tokens
                or existing.extra != extra
                or existing.is_partial != partial
            ):
                self.stats.collisions += 1
                return None
            pool.touch(existing)
            if owner is not None:
                pool.add_owner(existing, owner)
            self.stats.already_present += 1
            return existing
        if partial and not checkpointed(payload):
            cover = self._covering_child(parent, tokens, extra)
            if cover is not None:
                pool.touch(cover)
                self.stats.covered_partials += 1
                return cover
        if payload is None:
            raise ValueError(f"block {digest.hex()} is not stored and has no payload")
        nbytes = payload.nbytes
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"payload.nbytes must be an int >= 0, got {nbytes!r}")
        block = Block(
            digest, parent, tokens, extra, payload, nbytes, partial, namespace=namespace,
            stored_at=self._clock() if stored_at is None else stored_at,
        )
        if owner is not None:
            block.owners.add(owner)
        if not self._ram.reserve(nbytes, namespace):
            self.stats.rejected += 1
            self._spill(block)
            return None
        self._ram.charge(nbytes)
        pool.add(block)
        self._count_resident(block, 1)
        self.stats.inserts += 1
        self._supersede_partials(block)
        return block

    def _covering_child(
        self, parent: BlockHash, tokens: tuple[int, ...], extra: tuple[ExtraKey, ...]
    ) -> Block | None:
        count = len(tokens)
        for child in self._pool.children_of(parent).values():
            if (
                len(child.tokens) > count
                and child.tokens[:count] == tokens
                and keys_before(child.extra, count) == extra
            ):
                return child
        return None

    def _supersede_partials(self, block: Block) -> None:
        covered = [
            sibling
            for sibling in self._pool.children_of(block.parent).values()
            if sibling.is_partial
            and not checkpointed(sibling.payload)
            and len(sibling.tokens) < len(block.tokens)
            and block.tokens[: len(sibling.tokens)] == sibling.tokens
            and keys_before(block.extra, len(sibling.tokens)) == sibling.extra
        ]
        for sibling in covered:
            self._drop(sibling)
            self.stats.superseded_partials += 1

    # -- removal ------------------------------------------------------------------------------

    def discard(self, block: Block) -> None:
        """Drop a resident block without spilling it (erasure); a pinned one's bytes go
        when it is released."""
        self._drop(block)
        self.stats.discarded += 1

    def expire(self, block: Block) -> None:
        """Drop a resident block whose time to live is over, without spilling it."""
        self._drop(block)
        self.stats.expired += 1

    def remove_owner(self, session_id: str) -> list[Block]:
        """Forget a session as owner of every block.

        Returns:
            Resident blocks no one owns any more (the caller decides whether to discard).
        """
        return self._pool.remove_owner(session_id)

    def usage(self) -> Mapping[str | None, int]:
        """Resident bytes per tenant namespace (``Evictor`` protocol; read only)."""
        return MappingProxyType(self._usage)

    def oldest_access(self, namespace: str | None) -> int | None:
        """Access stamp of the next eviction victim of a namespace (``Evictor`` protocol)."""
        block = self._pool.oldest_free_of(namespace)
        return None if block is None else block.last_access

    def evict_oldest(self, namespace: str | None) -> int:
        """Evict the least recently used unreferenced block of a namespace (``Evictor``
        protocol).

        Returns:
            The bytes freed.
        """
        block = self._pool.oldest_free_of(namespace)
        if block is None:
            raise ValueError(f"no unreferenced block of namespace {namespace!r} to evict")
        self._pool.remove(block)
        self._count_resident(block, -1)
        self._ram.discharge(block.nbytes)
        self.stats.evictions += 1
        self.stats.evicted_bytes += block.nbytes
        self._spill(block)
        return block.nbytes

    def _drop(self, block: Block) -> None:
        self._pool.remove(block)
        self._count_resident(block, -1)
        if block.ref_count == 0:
            self._ram.discharge(block.nbytes)

    def _count_resident(self, block: Block, sign: int) -> None:
        self._resident_bytes += sign * block.nbytes
        used = self._usage.get(block.namespace, 0) + sign * block.nbytes
        assert used >= 0, (block.namespace, used)
        if used:
            self._usage[block.namespace] = used
        else:
            self._usage.pop(block.namespace, None)

    def watch_evictions(self, listener: Callable[[Block], None]) -> None:
        """Also tell ``listener`` of every block ``on_evict`` receives (before it does).

        For observers that must not take part in spilling, e.g. the ghost list of miss-reason
        attribution.
        """
        self._eviction_listeners.append(listener)

    def _spill(self, block: Block) -> None:
        for listener in self._eviction_listeners:
            listener(block)
        if self._on_evict is not None:
            self._on_evict(block)
