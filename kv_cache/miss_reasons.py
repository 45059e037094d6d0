"""Why a prompt block missed the prefix cache: cold, evicted, expired, diverged or isolated.

After every lookup the engine hands the request's chain to ``MissAttributor.attribute``, which
labels each full block the lookup did not match (the blocks a cache could have served: those
ending at or before the last prompt token) with one reason, checked in this order:

``expired``   the block was stored and dropped by its time to live (``record_expired``).
``evicted``   the block was stored and left RAM for room (``record_evicted``: a bounded ghost
              list of evicted hashes) and no lower tier gave it back (a block served from SSD
              is a hit), or the tenant sent these exact contents before but the ghost list has
              since forgotten the hash.
``diverged``  the first missed block only: the last matched block (or the root) has a stored
              child that takes another path here (a full block other than this one, or a partial
              one disagreeing within its length), so the request's tokens or images differ from
              what was stored at block k (an edited history, another image in the same place).
              Blocks after it are judged on their own (usually ``cold``).
``isolated``  another tenant sent the same contents (same tokens, same image pixels, same
              position), this tenant never did: the block would have hit without tenant salting.
``cold``      nothing of the above: the contents were never stored.

Isolation is detected without raw contents or tenant ids: every request's blocks get a
*content digest*, a chain hash like the block hash but rooted in a per-process random key
instead of the tenant salt and with images keyed by an unsalted pixel digest that the caller
supplies (also under that key). A bounded index maps content digests to the namespaces that sent
them. It never leaves this process, the key makes the digests useless outside it, and the
``isolated`` count is kept only in the global (admin) view: per-tenant views fold it into
``cold``, so a tenant cannot probe whether another tenant sent some prompt.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import xxhash

from kv_cache.block import Block
from kv_cache.hashing import BlockHash, ChainHasher, ImageSpan, block_extra_keys, token_array
from kv_cache.prefix_cache import tail_match

DEFAULT_GHOST_CAPACITY = 1 << 16
DEFAULT_CONTENT_CAPACITY = 1 << 15
_CONTENT_ROOT_TAG = b"vlmcache.kv.content-root\x00"


class MissReason(enum.StrEnum):
    """Why one block missed."""

    COLD = "cold"
    EVICTED = "evicted"
    EXPIRED = "expired"
    DIVERGED = "diverged"
    ISOLATED = "isolated"


# Tenant-facing views show these; ISOLATED is folded into COLD there (see the module docstring).
TENANT_REASONS: tuple[MissReason, ...] = (
    MissReason.COLD, MissReason.EVICTED, MissReason.EXPIRED, MissReason.DIVERGED)


class StoredChildren(Protocol):
    """The stored children of a block or root in the RAM tier (``BlockPool`` satisfies it)."""

    def children_of(self, parent: BlockHash) -> Mapping[BlockHash, Block]: ...


@dataclass(slots=True)
class MissCounts:
    """Missed blocks by reason, plus the blocks that hit (hot-path record).

    Attributes:
        hit_blocks: Full blocks matched by lookups.
        by_reason: Missed full blocks per reason.
    """

    hit_blocks: int = 0
    by_reason: dict[MissReason, int] = field(
        default_factory=lambda: {reason: 0 for reason in MissReason})

    @property
    def missed_blocks(self) -> int:
        return sum(self.by_reason.values())

    def add(self, report: MissReport) -> None:
        self.hit_blocks += report.hit_blocks
        for reason in report.reasons:
            self.by_reason[reason] += 1

    def as_dict(self, *, tenant_view: bool) -> dict[str, int]:
        """JSON-able counts; ``tenant_view`` folds ``isolated`` into ``cold``."""
        counts = {reason.value: self.by_reason[reason] for reason in MissReason}
        if tenant_view:
            counts[MissReason.COLD.value] += counts.pop(MissReason.ISOLATED.value)
        return counts


@dataclass(frozen=True, slots=True)
class MissReport:
    """Attribution of one lookup.

    Attributes:
        hit_blocks: Full blocks the lookup matched.
        reasons: One reason per missed full block, in chain order from the first miss.
    """

    hit_blocks: int
    reasons: tuple[MissReason, ...]

    @property
    def missed_blocks(self) -> int:
        return len(self.reasons)


class GhostList:
    """Bounded memory of block hashes that left the cache, with why (evicted or expired).

    The oldest entries are forgotten first; re-recording a hash refreshes it.
    """

    __slots__ = ("_capacity", "_entries")

    def __init__(self, capacity: int = DEFAULT_GHOST_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ghost list capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[BlockHash, MissReason] = OrderedDict()

    def record(self, block_hash: BlockHash, reason: MissReason) -> None:
        if reason not in (MissReason.EVICTED, MissReason.EXPIRED):
            raise ValueError(f"a ghost is evicted or expired, got {reason}")
        self._entries[block_hash] = reason
        self._entries.move_to_end(block_hash)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def get(self, block_hash: BlockHash) -> MissReason | None:
        return self._entries.get(block_hash)

    def __len__(self) -> int:
        return len(self._entries)


class ContentIndex:
    """Bounded map: content digest -> namespaces that sent a block with these contents."""

    __slots__ = ("_capacity", "_entries")

    def __init__(self, capacity: int = DEFAULT_CONTENT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"content index capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[bytes, frozenset[str]] = OrderedDict()

    def add(self, digest: bytes, namespace: str) -> None:
        known = self._entries.get(digest, frozenset())
        if namespace not in known:
            self._entries[digest] = known | {namespace}
        self._entries.move_to_end(digest)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def namespaces(self, digest: bytes) -> frozenset[str]:
        return self._entries.get(digest, frozenset())

    def forget_namespace(self, namespace: str) -> int:
        """Strike a namespace from every digest (tenant erasure). Returns the digests dropped."""
        dropped = 0
        for digest, known in list(self._entries.items()):
            if namespace in known:
                rest = known - {namespace}
                if rest:
                    self._entries[digest] = rest
                else:
                    del self._entries[digest]
                    dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._entries)


def content_root(key: bytes) -> BlockHash:
    """Root of the content-digest chains under a per-process key (no tenant salt in it)."""
    if len(key) < 16:
        raise ValueError(f"content key must be at least 16 bytes, got {len(key)}")
    return BlockHash(xxhash.xxh3_128_digest(_CONTENT_ROOT_TAG + key))


class MissAttributor:
    """Labels missed blocks with reasons and counts them, globally and per tenant namespace.

    Runs on the engine thread; counts are plain ints, safe to read from another thread.

    Args:
        block_size: Tokens per full block (the prefix cache's).
        key: Per-process secret for content digests (random by default).
        ghost_capacity: Hashes of evicted or expired blocks remembered.
        content_capacity: Content digests remembered for isolation and re-sent contents.
    """

    __slots__ = ("_block_size", "_key", "_content_root", "ghosts", "contents", "total",
                 "_by_namespace")

    def __init__(
        self,
        block_size: int,
        *,
        key: bytes | None = None,
        ghost_capacity: int = DEFAULT_GHOST_CAPACITY,
        content_capacity: int = DEFAULT_CONTENT_CAPACITY,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self._block_size = block_size
        self._key = key if key is not None else os.urandom(32)
        self._content_root = content_root(self._key)
        self.ghosts = GhostList(ghost_capacity)
        self.contents = ContentIndex(content_capacity)
        self.total = MissCounts()
        self._by_namespace: dict[str, MissCounts] = {}

    @property
    def content_key(self) -> bytes:
        """The per-process key; the caller digests image pixels under it (unsalted ids)."""
        return self._key

    # -- events from the tiers ----------------------------------------------------------------

    def record_evicted(self, block: Block) -> None:
        """A block left RAM for room (``PrefixCache`` eviction listener)."""
        self.ghosts.record(block.block_hash, MissReason.EVICTED)

    def record_expired(self, block_hash: BlockHash) -> None:
        """A block was dropped by its time to live (called by the TTL sweeper)."""
        self.ghosts.record(block_hash, MissReason.EXPIRED)

    def forget_namespace(self, namespace: str) -> None:
        """A tenant was erased: forget which contents it sent (its counts stay)."""
        self.contents.forget_namespace(namespace)

    # -- attribution ----------------------------------------------------------------------------

    def attribute(
        self,
        *,
        root: BlockHash,
        tokens: Sequence[int] | np.ndarray,
        spans: Sequence[ImageSpan],
        content_spans: Sequence[ImageSpan],
        matched_blocks: int,
        stored: StoredChildren,
        namespace: str,
    ) -> MissReport:
        """Label the missed blocks of one lookup, count them, and remember the contents.

        Args:
            root: The request's root hash (tenant-salted).
            tokens: The prompt's token ids.
            spans: Its image spans (tenant-salted image hashes).
            content_spans: The same spans keyed by unsalted image digests under
                ``content_key`` (same order and positions as ``spans``).
            matched_blocks: Full blocks the lookup matched.
            stored: The RAM tier's blocks (for the divergence check).
            namespace: The tenant's namespace.

        Returns:
            The report; its counts are already added to the totals.
        """
        if len(content_spans) != len(spans) or any(
            (a.start, a.end) != (b.start, b.end) for a, b in zip(spans, content_spans)
        ):
            raise ValueError("content_spans must have the positions of spans")
        array = token_array(tokens)
        size = self._block_size
        reusable = max(len(array) - 1, 0) // size
        if not 0 <= matched_blocks <= reusable:
            raise ValueError(f"matched_blocks {matched_blocks} outside 0..{reusable}")
        token_bytes = array.tobytes()
        hashes = ChainHasher(root, token_bytes, spans, size).hashes(reusable)
        contents = ChainHasher(self._content_root, token_bytes, content_spans, size).hashes(
            reusable)
        ids = tuple(array.tolist())
        reasons = tuple(
            self._reason(index, matched_blocks, hashes, contents, root, stored, namespace, ids,
                         spans)
            for index in range(matched_blocks, reusable)
        )
        for digest in contents:
            self.contents.add(digest, namespace)
        report = MissReport(matched_blocks, reasons)
        self.total.add(report)
        self._by_namespace.setdefault(namespace, MissCounts()).add(report)
        return report

    def _reason(
        self,
        index: int,
        first_miss: int,
        hashes: list[BlockHash],
        contents: list[BlockHash],
        root: BlockHash,
        stored: StoredChildren,
        namespace: str,
        ids: tuple[int, ...],
        spans: Sequence[ImageSpan],
    ) -> MissReason:
        ghost = self.ghosts.get(hashes[index])
        if ghost is not None:
            return ghost
        senders = self.contents.namespaces(contents[index])
        if namespace in senders:
            # Sent before by this tenant, neither resident nor remembered as a ghost: it left
            # the cache longer ago than the ghost list reaches.
            return MissReason.EVICTED
        if index == first_miss:
            parent = hashes[index - 1] if index else root
            if self._diverges(stored.children_of(parent), hashes[index], ids, index, spans):
                return MissReason.DIVERGED
        if senders:
            return MissReason.ISOLATED
        return MissReason.COLD

    def _diverges(
        self,
        children: Mapping[BlockHash, Block],
        wanted: BlockHash,
        tokens: tuple[int, ...],
        index: int,
        spans: Sequence[ImageSpan],
    ) -> bool:
        """Whether a stored child of the parent takes another path at block ``index``.

        Any full child but the wanted block differs in tokens or image keys. A partial child
        differs only if it disagrees within its own length: one that is a prefix of the wanted
        block is where a stored sequence simply ended (the rest is cold, not diverged).
        """
        size = self._block_size
        start = index * size
        window = tokens[start : start + size]
        window_extra = block_extra_keys(start, size, spans)
        for child_hash, child in children.items():
            if child_hash == wanted:
                continue
            if not child.is_partial:
                return True
            count = child.num_tokens
            if tail_match(child.tokens, child.extra, window, window_extra, count) < count:
                return True
        return False

    # -- views ----------------------------------------------------------------------------------

    def counts(self, namespace: str | None) -> MissCounts:
        """Counts of one namespace, or of all when None (the live object: read only)."""
        if namespace is None:
            return self.total
        return self._by_namespace.get(namespace, MissCounts())

