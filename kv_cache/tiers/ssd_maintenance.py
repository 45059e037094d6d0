"""Removal of SSD records by rule: capacity and quotas, retention, erasure (rows and files).

Functions over an index and its layout, used by the open tier (``SsdTier``, which keeps its
counters from what they return) and by the offline tools (``vlmcache cache``, on a stopped
server). A row is deleted before its file is unlinked, so a reader that raced the removal finds
no row (a miss) or a row whose file is gone (also a miss, and the row is dropped); never a
file of someone else.

```
 capacity:  requester over its quota -> its own LRU rows;  total over budget -> LRU rows of the
            requester and of tenants above their guarantee (``kv_cache.tiers.quota``)
 retention: rows of a namespace stored before its cutoff
 erasure:   every row of a namespace; or the rows an owner (session) alone holds, the owner
            struck from the rows it shares (``split_owned``)
```
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from kv_cache.tally import Tally
from kv_cache.tiers.quota import eviction_candidates
from kv_cache.tiers.ssd_files import prune_empty_dirs
from kv_cache.tiers.ssd_index import IndexRow, RecordKind, SsdIndex
from kv_cache.tiers.ssd_layout import SsdLayout
from kv_cache.tiers.ssd_reconcile import quarantined_files

# Rows fetched per capacity query.
_BATCH = 16

K = TypeVar("K", bound=Hashable)


def delete_rows(index: SsdIndex, layout: SsdLayout, rows: Iterable[IndexRow]) -> list[IndexRow]:
    """Delete rows and unlink their files; rows already gone are skipped.

    Returns:
        The rows this call deleted (with the sizes they had in the index).
    """
    deleted = []
    for row in rows:
        gone = index.delete(row.kind, row.key)
        if gone is None:
            continue
        layout.path(gone.kind, gone.namespace, gone.key).unlink(missing_ok=True)
        deleted.append(gone)
    return deleted


def prune_namespace_dirs(layout: SsdLayout, rows: Iterable[IndexRow]) -> None:
    """Remove the directories the deleted ``rows`` leave empty (up to the kind's tree)."""
    seen: set[Path] = set()
    for row in rows:
        directory = layout.path(row.kind, row.namespace, row.key).parent
        if directory not in seen:
            seen.add(directory)
            prune_empty_dirs(directory, layout.tree(row.kind))


def tallies(rows: Iterable[IndexRow]) -> dict[RecordKind, Tally]:
    """File count and bytes of ``rows`` per record kind (every kind present, maybe empty)."""
    out = dict.fromkeys(RecordKind, Tally())
    for row in rows:
        out[row.kind] = out[row.kind] + Tally(1, row.size)
    return out


def enforce_capacity(
    index: SsdIndex,
    layout: SsdLayout,
    budget: int,
    quotas: Mapping[str, int],
    usage: dict[str, int],
    requester: str | None = None,
) -> list[IndexRow]:
    """Delete least recently used rows until the requester fits its quota and everyone the
    budget, taking room only from the requester and tenants above their guarantee.

    Args:
        index: The index.
        layout: Its files.
        budget: Capacity in file bytes.
        quotas: Quota in file bytes per namespace that has one.
        usage: File bytes per namespace; updated as rows go.
        requester: Namespace whose write made room necessary (None: only tenants above their
            guarantee give room, e.g. at startup or after a budget change).

    Returns:
        The rows deleted, in deletion order.
    """
    deleted: list[IndexRow] = []
    quota = quotas.get(requester) if requester is not None else None
    if quota is not None:
        own = requester

        def over_quota() -> set[str]:
            return {own} if usage.get(own, 0) > quota else set()

        _delete_while(index, layout, usage, deleted, over_quota)

    def over_budget() -> set[str]:
        if sum(usage.values()) <= budget:
            return set()
        candidates = eviction_candidates(budget, quotas, usage, requester)
        return {ns for ns in candidates if ns is not None}

    _delete_while(index, layout, usage, deleted, over_budget)
    return deleted


def enforce_quotas(
    index: SsdIndex, layout: SsdLayout, quotas: Mapping[str, int], usage: dict[str, int]
) -> list[IndexRow]:
    """Delete each over-quota tenant's own least recently used rows until it fits its quota
    (offline gc: no tenant is writing).

    Returns:
        The rows deleted.
    """
    deleted: list[IndexRow] = []
    for namespace, quota in sorted(quotas.items()):

        def over(ns: str = namespace, limit: int = quota) -> set[str]:
            return {ns} if usage.get(ns, 0) > limit else set()

        _delete_while(index, layout, usage, deleted, over)
    return deleted


def _delete_while(
    index: SsdIndex,
    layout: SsdLayout,
    usage: dict[str, int],
    deleted: list[IndexRow],
    victims: Callable[[], set[str]],
) -> None:
    """Delete the least recently used row of the namespaces ``victims()`` names, as long as it
    names any (re-asked after every deletion: each one changes usage and guarantees)."""
    while names := victims():
        batch = index.oldest(_BATCH, names)
        if not batch:
            return
        for row in batch:
            if row.namespace not in names:
                break  # the candidates changed: ask the index again
            gone = delete_rows(index, layout, [row])
            _account(usage, gone)
            deleted.extend(gone)
            names = victims()
            if not names:
                return


def _account(usage: dict[str, int], rows: Sequence[IndexRow]) -> None:
    for row in rows:
        left = usage.get(row.namespace, 0) - row.size
        if left > 0:
            usage[row.namespace] = left
        else:
            usage.pop(row.namespace, None)


def expire(index: SsdIndex, layout: SsdLayout, cutoffs: Mapping[str, float]) -> list[IndexRow]:
    """Delete the rows (and files) of each namespace stored before its cutoff.

    Args:
        cutoffs: ``now - retention`` per namespace with a retention.

    Returns:
        The rows deleted.
    """
    deleted: list[IndexRow] = []
    for namespace, cutoff in sorted(cutoffs.items()):
        deleted.extend(delete_rows(index, layout, index.stored_before(namespace, cutoff)))
    return deleted


def expire_quarantine(layout: SsdLayout, retention: Mapping[str, float], now: float) -> int:
    """Delete quarantined files of namespaces with a retention once older than it (counted
    from the quarantine time: the content's own age is unreadable). Returns the files deleted."""
    removed = 0
    for found in quarantined_files(layout):
        seconds = retention.get(found.namespace)
        if seconds is not None and found.quarantined_ns / 1e9 < now - seconds:
            found.path.unlink(missing_ok=True)
            removed += 1
    return removed


def erase_namespace(index: SsdIndex, layout: SsdLayout, namespace: str) -> list[IndexRow]:
    """Delete every row and file of a namespace, its quarantined files, and its emptied
    directories.

    Returns:
        The rows deleted.
    """
    deleted = delete_rows(index, layout, index.of_namespace(namespace))
    prune_namespace_dirs(layout, deleted)
    for found in quarantined_files(layout):
        if found.namespace == namespace:
            found.path.unlink(missing_ok=True)
    return deleted


def split_owned(
    owner: str, holdings: Iterable[tuple[K, Iterable[str]]]
) -> tuple[set[K], dict[K, frozenset[str]]]:
    """Which keys an erased owner alone holds, and which it shares with whom.

    Args:
        owner: The session being erased.
        holdings: ``(key, owners)`` of every copy of the owner's records, in every tier (a key
            may appear once per tier; the owners of all its copies count together).

    Returns:
        ``(doomed, shared)``: keys no other owner holds (to delete everywhere), and the other
        keys with their owners besides ``owner`` (to keep, every copy listing exactly those).
    """
    owners: dict[K, set[str]] = {}
    for key, found in holdings:
        owners.setdefault(key, set()).update(found)
    doomed = {key for key, found in owners.items() if not found - {owner}}
    shared = {key: frozenset(found - {owner}) for key, found in owners.items() if key not in doomed}
    return doomed, shared


def erase_owner(index: SsdIndex, layout: SsdLayout, namespace: str, owner: str) -> tuple[list[IndexRow], int]:
    """Offline erasure of one session on the index alone (no RAM copies exist).

    Returns:
        The rows deleted, and how many shared rows kept with ``owner`` struck from them.
    """
    rows = index.owned_by(namespace, owner)
    doomed, shared = split_owned(owner, (((row.kind, row.key), row.owners) for row in rows))
    deleted = delete_rows(index, layout, [row for row in rows if (row.kind, row.key) in doomed])
    prune_namespace_dirs(layout, deleted)
    for row in rows:
        others = shared.get((row.kind, row.key))
        if others is not None:
            index.set_owners(row.kind, row.key, sorted(others))
    return deleted, len(shared)
