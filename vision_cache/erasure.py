"""Erasure of a session's vision features from RAM and the SSD tier.

The same rule as KV blocks (``kv_cache.erasure``): features whose owners, over their RAM entry
and their SSD row, are the erased session alone are removed from both; features another session
of the tenant also used stay, with the session struck from their owners. Features stored without
a session go only with their tenant (``FeatureCache.remove_namespace`` and
``SsdTier.erase_namespace``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_cache.tally import Tally
from kv_cache.tiers.ssd_maintenance import split_owned
from vision_cache.feature_cache import FeatureCache, FeatureKey
from vision_cache.ssd import FeatureSsd


@dataclass(frozen=True, slots=True)
class FeatureErasure:
    """What an erasure removed from the vision-feature tiers.

    Attributes:
        ram: Entries removed from the RAM cache and their bytes.
        ssd: Files removed and their file bytes.
        kept_shared: Features of the session kept because another session used them too.
    """

    ram: Tally = Tally()
    ssd: Tally = Tally()
    kept_shared: int = 0


def erase_feature_owner(
    features: FeatureCache, ssd: FeatureSsd | None, namespace: str, owner: str
) -> FeatureErasure:
    """Erase the features session ``owner`` of tenant ``namespace`` alone used, in both tiers.

    The caller flushes the SSD tier's write queue first (``SsdTier.flush``; ``FeatureSsd.delete``
    does too), so queued features of the session are rows by then.

    Returns:
        What was removed, per tier, and how many shared features were kept.
    """
    in_ram = features.owned_by(namespace, owner)
    on_disk = ssd.owned(namespace, owner) if ssd is not None else {}
    # Copies that do not list the owner still count: their owners keep the features alive.
    if ssd is not None:
        on_disk.update(
            (key, owners)
            for key, owners in ssd.owners_of([k for k in in_ram if k not in on_disk], namespace).items()
        )
    for key in on_disk:
        if key not in in_ram and (owners := features.owners(key)) is not None:
            in_ram[key] = owners
    holdings = [*in_ram.items(), *on_disk.items()]
    doomed, shared = split_owned(owner, holdings)

    order = _sorted(doomed)
    ram = features.erase([key for key in order if key in in_ram])
    # Shared features: every copy lists exactly the other owners.
    for key, others in shared.items():
        if key in in_ram:
            features.discard_owner(key, owner)
            for other in others - in_ram[key]:
                features.add_owner(key, other)
    disk = Tally()
    if ssd is not None:
        disk = ssd.delete([key for key in order if key in on_disk])
        for key in _sorted(set(shared)):
            owners = on_disk.get(key)
            if owners is not None and set(owners) != shared[key]:
                ssd.set_owners(key, sorted(shared[key]))
    return FeatureErasure(ram, disk, len(shared))


def _sorted(keys: set[FeatureKey]) -> list[FeatureKey]:
    """Feature keys in a deterministic order (by image hash)."""
    return sorted(keys, key=lambda k: bytes(k.image_hash))
