"""Vision features on the SSD tier: written when encoded, read back on a RAM miss.

Features are written through (queued when the encoder produces them), not only when RAM
evicts them: an image's features cost a vision-tower run, so a restarted or crashed server
finds every image it ever encoded without a shutdown flush. They share the KV blocks' tier (one
index, one capacity, one writer) under their own tree::

    <cache_dir>/vision/<fp16>/<tenant namespace>/<hh>/<hh>/<image hash>.safetensors

The key is the tenant-salted image hash, so tenants never share a file; the file also records
the model fingerprint and the namespace, both checked on read, and when the features were
computed (``stored_at``: retention) and the sessions that produced them (``owners``: erasure;
the index row's owners also gain every session that reads them back).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kv_cache.serialization import (
    FILE_FORMAT_VERSION,
    CorruptFileError,
    ParsedFile,
    host_tensor,
    to_array,
)
from kv_cache.tally import Tally
from kv_cache.tiers.ssd import SsdTier
from kv_cache.tiers.ssd_index import IndexRow, RecordKind
from vision_cache.feature_cache import CachedFeatures, FeatureKey
from vision_cache.hashing import ImageHash

VISION_FORMAT = "vlmcache.vision_features"
_TENSOR = "features"


@dataclass(slots=True)
class FeatureSsdStats:
    """Counters of vision features on SSD.

    Attributes:
        stores: Features queued for writing.
        not_stored: Features not queued (write queue full, or not a single array).
        hits: RAM misses answered from SSD (or the write queue).
        misses: RAM misses SSD could not answer.
    """

    stores: int = 0
    not_stored: int = 0
    hits: int = 0
    misses: int = 0


@dataclass(frozen=True, slots=True)
class LoadedFeatures:
    """Features read back from SSD.

    Attributes:
        features: The features.
        stored_at: When they were computed (retention keeps counting from it in RAM).
        owners: Sessions the index lists for them.
    """

    features: CachedFeatures
    stored_at: float
    owners: tuple[str, ...]


class FeatureCodec:
    """Recognises vision-feature files of one model (for reconcile)."""

    kind = RecordKind.VISION

    def __init__(self, fingerprint: str) -> None:
        self._fingerprint = fingerprint

    def index_row(
        self, parsed: ParsedFile, namespace: str, key: bytes, size: int, stamp: int
    ) -> IndexRow:
        meta = _check(parsed, self._fingerprint, namespace, key)
        return IndexRow(
            RecordKind.VISION, key, namespace, size, int(meta["nbytes"]), stamp,
            owners=tuple(meta.get("owners", ())), stored_at=float(meta.get("stored_at", 0.0)),
        )


class FeatureSsd:
    """Vision features of one model on an ``SsdTier`` (which must have a ``FeatureCodec``).

    Args:
        tier: The SSD tier.
        fingerprint: The model fingerprint the features belong to.
    """

    def __init__(self, tier: SsdTier, fingerprint: str) -> None:
        self._tier = tier
        self._fingerprint = fingerprint
        self.stats = FeatureSsdStats()

    def store(
        self,
        key: FeatureKey,
        features: CachedFeatures,
        namespace: str,
        *,
        owner: str | None = None,
        stored_at: float,
    ) -> bool:
        """Queue one image's features for writing (engine thread; arrays evaluated).

        Args:
            key: Image hash + model fingerprint.
            features: The features (a single evaluated array).
            namespace: Tenant storage namespace.
            owner: Session that produced them.
            stored_at: When they were computed (wall-clock seconds).

        Returns:
            Whether they are (or will be) on disk; False when the queue was full or the
            features are not a single array.
        """
        self._check_key(key)
        array = features.features
        if not isinstance(array, mx.array):
            self.stats.not_stored += 1
            return False
        metadata = {
            "format": VISION_FORMAT,
            "file_version": FILE_FORMAT_VERSION,
            "fingerprint": self._fingerprint,
            "image_hash": bytes(key.image_hash).hex(),
            "namespace": namespace,
            "meta": _to_json(features.meta),
            "nbytes": features.nbytes,
            "owners": [] if owner is None else [owner],
            "stored_at": stored_at,
        }
        stored = self._tier.store(
            RecordKind.VISION,
            bytes(key.image_hash),
            namespace,
            (host_tensor(_TENSOR, array),),
            metadata,
            features,
            features.nbytes,
            owners=() if owner is None else (owner,),
            stored_at=stored_at,
        )
        if stored:
            self.stats.stores += 1
        else:
            self.stats.not_stored += 1
        return stored

    def load(
        self, key: FeatureKey, namespace: str, *, expired_before: float | None = None
    ) -> LoadedFeatures | None:
        """One image's features from SSD, verified; None when absent, expired (then deleted)
        or bad (quarantined).

        Args:
            key: Image hash + model fingerprint.
            namespace: The caller's tenant namespace.
            expired_before: Retention cutoff of the tenant (None: no retention).
        """
        self._check_key(key)
        image = bytes(key.image_hash)

        def decode(parsed: ParsedFile) -> CachedFeatures:
            meta = _check(parsed, self._fingerprint, namespace, image)
            tensor = parsed.tensors[_TENSOR]
            features = CachedFeatures.of(to_array(tensor.dtype, tensor.shape, tensor.data), _from_json(meta["meta"]))
            if features.nbytes != meta["nbytes"]:
                raise CorruptFileError(f"features hold {features.nbytes} bytes, metadata says {meta['nbytes']}")
            return features

        found = self._tier.load(RecordKind.VISION, image, namespace, decode, expired_before=expired_before)
        if found is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return LoadedFeatures(found.value, found.stored_at, found.owners)

    def add_owner(self, key: FeatureKey, owner: str) -> None:
        """Record that a session uses stored features (kept through RAM eviction: features are
        not spilled again, so their row must know every user for session erasure)."""
        self._check_key(key)
        self._tier.add_owner(RecordKind.VISION, bytes(key.image_hash), owner)

    # -- erasure ------------------------------------------------------------------------------

    def owned(self, namespace: str, owner: str) -> dict[FeatureKey, tuple[str, ...]]:
        """Stored features of a tenant that list ``owner``, with all their owners (flush the
        tier first to include queued ones)."""
        return {
            FeatureKey(ImageHash(row.key), self._fingerprint): row.owners
            for row in self._tier.owned_rows(namespace, owner)
            if row.kind is RecordKind.VISION
        }

    def owners_of(self, keys: list[FeatureKey], namespace: str) -> dict[FeatureKey, tuple[str, ...]]:
        """Owners of those of ``keys`` stored under ``namespace``."""
        rows = self._tier.rows_of(RecordKind.VISION, [bytes(k.image_hash) for k in keys])
        return {
            FeatureKey(ImageHash(key), self._fingerprint): row.owners
            for key, row in rows.items()
            if row.namespace == namespace
        }

    def set_owners(self, key: FeatureKey, owners: list[str]) -> None:
        """Replace stored features' owners (a session erased from shared features)."""
        self._check_key(key)
        self._tier.set_owners(RecordKind.VISION, bytes(key.image_hash), owners)

    def delete(self, keys: list[FeatureKey]) -> Tally:
        """Delete stored features (rows, files). Returns files deleted and their bytes."""
        for key in keys:
            self._check_key(key)
        return self._tier.delete(RecordKind.VISION, [bytes(k.image_hash) for k in keys])

    def _check_key(self, key: FeatureKey) -> None:
        if key.model_fingerprint != self._fingerprint:
            raise ValueError(
                f"features of model {key.model_fingerprint!r} cannot go to the SSD tier of "
                f"{self._fingerprint!r}"
            )


def check_record(parsed: ParsedFile, fingerprint: str, namespace: str, key: bytes) -> Mapping[str, Any]:
    """The metadata of a verified vision-features file, checked against the model, namespace and
    image hash it is filed under.

    Raises:
        CorruptFileError: It is not such a record.
    """
    return _check(parsed, fingerprint, namespace, key)


def _check(parsed: ParsedFile, fingerprint: str, namespace: str, key: bytes) -> Mapping[str, Any]:
    m = parsed.metadata
    try:
        if m["format"] != VISION_FORMAT or m["file_version"] != FILE_FORMAT_VERSION:
            raise ValueError(f"record {m['format']!r} v{m['file_version']}")
        if m["fingerprint"] != fingerprint:
            raise ValueError(f"features of model {m['fingerprint']!r}")
        if m["image_hash"] != key.hex() or m["namespace"] != namespace:
            raise ValueError(f"features of {m['image_hash']} in {m['namespace']!r}")
        if set(parsed.tensors) != {_TENSOR}:
            raise ValueError(f"tensors {sorted(parsed.tensors)}")
        int(m["nbytes"])
        dict(m["meta"])
        float(m.get("stored_at", 0.0))
        if not all(isinstance(owner, str) for owner in m.get("owners", ())):
            raise ValueError(f"owners {m['owners']!r}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptFileError(f"bad vision record: {exc}") from None
    return m


def _to_json(value: Any) -> Any:
    """Features metadata as JSON (tuples become lists; ``_from_json`` turns them back)."""
    if isinstance(value, Mapping):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"features metadata value {value!r} is not JSON-serialisable")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value
