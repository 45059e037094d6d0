"""Vision features for one image: RAM cache, then SSD, then the vision tower.

Owners (session ids) are recorded on every copy so session erasure knows who still uses an
image's features; features are written to SSD when encoded (not on RAM eviction), so a
restarted server finds every image it ever encoded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from server.engine.prompt import PromptImage
from vision_cache.encoders import VisionEncoder
from vision_cache.feature_cache import CachedFeatures, FeatureCache, FeatureKey
from vision_cache.ssd import FeatureSsd


@dataclass(frozen=True, slots=True)
class FeatureResult:
    features: mx.array
    hit: bool  # served from a cache tier (no vision-tower run)


class FeatureProvider:
    def __init__(
        self,
        *,
        encoder: VisionEncoder,
        fingerprint: str,
        ram: FeatureCache,
        ssd: FeatureSsd | None,
        clock: Callable[[], float],
    ) -> None:
        self._encoder = encoder
        self._fingerprint = fingerprint
        self._ram = ram
        self._ssd = ssd
        self._clock = clock

    def features_for(
        self, img: PromptImage, namespace: str, session: str | None, cutoff: float | None
    ) -> FeatureResult:
        """Features of ``img`` for a request of ``session`` in tenant ``namespace``.

        Args:
            cutoff: entries stored before this time are expired (None: no retention).
        """
        key = FeatureKey(img.span.image_hash, self._fingerprint)
        cached = self._ram.get(key, namespace=namespace, expired_before=cutoff)
        if cached is not None and session is not None and self._ram.add_owner(key, session):
            if self._ssd is not None:
                # Features are not spilled again on eviction: their row must know every user.
                self._ssd.add_owner(key, session)
        if cached is None and self._ssd is not None:
            loaded = self._ssd.load(key, namespace, expired_before=cutoff)
            if loaded is not None:
                cached = loaded.features
                self._ram.put(key, cached, namespace=namespace, stored_at=loaded.stored_at)
                for owner in loaded.owners:
                    self._ram.add_owner(key, owner)
                if session is not None and session not in loaded.owners:
                    self._ram.add_owner(key, session)
                    self._ssd.add_owner(key, session)
        if cached is not None:
            return FeatureResult(cached.features, hit=True)
        feats = self._encoder.encode(img.part.image)
        mx.eval(feats)
        stored = CachedFeatures.of(
            feats, {"num_tokens": img.layout.num_tokens, "grid_thw": img.layout.grid_thw}
        )
        stored_at = self._clock()
        self._ram.put(key, stored, namespace=namespace, owner=session, stored_at=stored_at)
        if self._ssd is not None:
            self._ssd.store(key, stored, namespace, owner=session, stored_at=stored_at)
        return FeatureResult(feats, hit=False)
