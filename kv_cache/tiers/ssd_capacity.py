"""Per-tenant usage of the SSD tier, its quotas, and the capacity passes that enforce them.

One lock guards the usage map, the quotas and every capacity pass: the writer thread runs a
pass after each commit (the writing tenant is the requester), the engine thread after a quota
change; erasure and retention report what they deleted through ``forget``.
"""

from __future__ import annotations

import threading

from kv_cache.tiers import ssd_maintenance
from kv_cache.tiers.ssd_index import IndexRow, SsdIndex
from kv_cache.tiers.ssd_layout import SsdLayout, check_namespace


class SsdCapacity:
    """File bytes per tenant namespace, quotas, and the budget.

    Args:
        index: The tier's index (usage starts from its totals).
        layout: The tier's files.
        budget_bytes: Capacity in file bytes.
    """

    def __init__(self, index: SsdIndex, layout: SsdLayout, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"SSD budget must be >= 0 bytes, got {budget_bytes}")
        self._index = index
        self._layout = layout
        self._budget = budget_bytes
        self._lock = threading.Lock()
        self._usage = {ns: size for ns, (_, size) in index.namespace_totals().items()}
        self._quotas: dict[str, int] = {}

    @property
    def budget_bytes(self) -> int:
        return self._budget

    def usage(self) -> dict[str, int]:
        """File bytes per namespace (a snapshot)."""
        with self._lock:
            return dict(self._usage)

    def quotas(self) -> dict[str, int]:
        """Quota per namespace that has one (a snapshot)."""
        with self._lock:
            return dict(self._quotas)

    def set_quota(self, namespace: str, quota_bytes: int | None) -> list[IndexRow]:
        """Set (None: remove) a tenant's quota, deleting its own LRU files until it fits.

        Returns:
            The rows deleted.
        """
        check_namespace(namespace)
        if quota_bytes is not None and quota_bytes < 0:
            raise ValueError(f"SSD quota must be >= 0 bytes, got {quota_bytes}")
        with self._lock:
            if quota_bytes is None:
                self._quotas.pop(namespace, None)
                return []
            self._quotas[namespace] = quota_bytes
        return self.enforce(namespace)

    def enforce(self, requester: str | None) -> list[IndexRow]:
        """One capacity pass (``ssd_maintenance.enforce_capacity``). Returns the rows deleted."""
        with self._lock:
            return ssd_maintenance.enforce_capacity(
                self._index, self._layout, self._budget, self._quotas, self._usage, requester
            )

    def commit(self, row: IndexRow) -> IndexRow | None:
        """Index a written file's row and count it. Returns the row it replaced, if any."""
        with self._lock:
            old = self._index.get(row.kind, [row.key]).get(row.key)
            self._index.put(row)
            self._add(row.namespace, row.size)
            if old is not None:
                self._add(old.namespace, -old.size)
        return old

    def forget(self, rows: list[IndexRow]) -> None:
        """Account rows deleted outside a capacity pass (erasure, retention, failed reads)."""
        with self._lock:
            for row in rows:
                self._add(row.namespace, -row.size)

    def _add(self, namespace: str, delta: int) -> None:
        left = self._usage.get(namespace, 0) + delta
        if left > 0:
            self._usage[namespace] = left
        else:
            self._usage.pop(namespace, None)
