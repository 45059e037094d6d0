"""Engine-side miss diagnosis: attribute every lookup's missed blocks, watch the hit rate.

Glue between the runner and ``kv_cache.miss_reasons`` / ``kv_cache.hit_rate``: it supplies the
unsalted image digests that isolation detection needs (pixels digested under the attributor's
per-process key, memoised by the salted image hash so a picture re-sent every turn is digested
once) and feeds each report to the rolling hit-rate monitor. Runs on the engine thread.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kv_cache.block import Block
from kv_cache.hashing import BlockHash, ImageSpan
from kv_cache.hit_rate import DEFAULT_THRESHOLD, DEFAULT_WINDOW, HitRateMonitor
from kv_cache.miss_reasons import MissAttributor, MissReport, StoredChildren
from server.engine.prompt import BuiltPrompt, PromptImage
from vision_cache.hashing import ImageHash, image_hash

# Salted image hash -> unsalted digest; a few hundred distinct recent images is plenty.
_IMAGE_MEMO = 512


class MissTracker:
    """Miss reasons and the rolling hit-rate warning of one engine.

    Args:
        block_size: Tokens per block of the prefix cache.
        threshold: Rolling block hit rate below which one warning is logged (0 disables).
        window: Lookups in the rolling window.
        key: Per-process key of content digests (random by default; tests pass one).
    """

    __slots__ = ("attributor", "monitor", "_image_ids")

    def __init__(
        self,
        block_size: int,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        window: int = DEFAULT_WINDOW,
        key: bytes | None = None,
    ) -> None:
        self.attributor = MissAttributor(block_size, key=key)
        self.monitor = HitRateMonitor(threshold, window)
        self._image_ids: OrderedDict[ImageHash, ImageHash] = OrderedDict()

    def record_evicted(self, block: Block) -> None:
        """Eviction listener of the prefix cache (remembers the hash as a ghost)."""
        self.attributor.record_evicted(block)

    def record_expired(self, block_hash: BlockHash) -> None:
        """For the TTL sweeper: a block was dropped because it expired."""
        self.attributor.record_expired(block_hash)

    def forget_namespace(self, namespace: str) -> None:
        """Tenant erasure: drop what attribution remembers of the tenant's contents."""
        self.attributor.forget_namespace(namespace)

    def observe(
        self,
        *,
        root: BlockHash,
        prompt: BuiltPrompt,
        matched_blocks: int,
        stored: StoredChildren,
        namespace: str,
    ) -> MissReport:
        """Attribute the misses of one lookup and update the rolling hit rate."""
        report = self.attributor.attribute(
            root=root,
            tokens=prompt.token_ids,
            spans=prompt.spans,
            content_spans=tuple(self._content_span(img) for img in prompt.images),
            matched_blocks=matched_blocks,
            stored=stored,
            namespace=namespace,
        )
        self.monitor.observe(report)
        return report

    def stats(self, namespace: str | None) -> dict[str, Any]:
        """JSON-able miss reasons of one tenant (``isolated`` folded into ``cold``), or of all
        tenants with ``isolated`` and the rolling hit rate when ``namespace`` is None."""
        counts = self.attributor.counts(namespace)
        tenant_view = namespace is not None
        out: dict[str, Any] = {
            "hit_blocks": counts.hit_blocks,
            "missed_blocks": counts.missed_blocks,
            "miss_reasons": counts.as_dict(tenant_view=tenant_view),
        }
        if not tenant_view:
            out["rolling_block_hit_rate"] = self.monitor.hit_rate
            out["hit_rate_warnings"] = self.monitor.warning_count
        return out

    def _content_span(self, image: PromptImage) -> ImageSpan:
        span = image.span
        salted = ImageHash(span.image_hash)
        unsalted = self._image_ids.get(salted)
        if unsalted is None:
            unsalted = image_hash(self.attributor.content_key, image.part.image)
            self._image_ids[salted] = unsalted
            if len(self._image_ids) > _IMAGE_MEMO:
                self._image_ids.popitem(last=False)
        else:
            self._image_ids.move_to_end(salted)
        return ImageSpan(unsalted, span.start, span.end)
