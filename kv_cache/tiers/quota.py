"""The per-tenant share rule of a byte budget shared by tenants (RAM tier, SSD tier).

```
 quota(ns)        a tenant's configured ceiling (None: no ceiling, no guarantee)
 guarantee(ns)    quota(ns) * min(1, budget / sum of the quotas of the tenants present)
 own eviction     a tenant over its quota gives back its own least recently used entries
 shared eviction  room under the budget is taken, least recently used first, only from the
                  requester itself and from tenants holding more than their guarantee
```

So a tenant with a quota keeps its whole quota as long as the quotas of the tenants present add
up to no more than the budget, and a proportional part of it when they are overcommitted; the
guarantees never add up to more than the budget, so the rule can always be met. A tenant
without a quota is guaranteed nothing: it lives on what guaranteed tenants leave free, in plain
LRU order with the others. Another tenant's traffic can therefore never push a tenant below
``min(its usage, its guarantee)``; only its own traffic (or its own quota) can.

Pure functions over namespace -> bytes maps; the tiers own the bytes and the eviction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# A tier files entries under a tenant namespace; None for entries of no tenant (tests, tools).
Namespace = str | None


def guarantees(
    budget: int, quotas: Mapping[Namespace, int | None], present: Iterable[Namespace]
) -> dict[Namespace, int]:
    """Guaranteed bytes of each present namespace.

    Args:
        budget: The shared budget in bytes.
        quotas: Quota per namespace; a missing or None quota means none.
        present: Namespaces holding bytes now (and the one asking for room).

    Returns:
        ``floor(quota * min(1, budget / sum of present quotas))`` per present namespace, 0 for
        those without a quota. The values add up to at most ``budget``.
    """
    names = set(present)
    quoted = {ns: q for ns in names if (q := quotas.get(ns)) is not None}
    total = sum(quoted.values())
    out = dict.fromkeys(names, 0)
    for ns, quota in quoted.items():
        # Integer arithmetic: the floors keep the sum within the budget exactly.
        out[ns] = quota if total <= budget else quota * budget // total
    return out


def eviction_candidates(
    budget: int,
    quotas: Mapping[Namespace, int | None],
    usage: Mapping[Namespace, int],
    requester: Namespace,
) -> set[Namespace]:
    """Namespaces whose entries may be evicted to make room in the shared budget for
    ``requester``: the requester itself and every namespace above its guarantee.

    Args:
        budget: The shared budget in bytes.
        quotas: Quota per namespace (None or missing: none).
        usage: Bytes held per namespace.
        requester: The namespace that needs room.

    Returns:
        The candidate namespaces (the requester is always one).
    """
    present = [ns for ns, used in usage.items() if used > 0]
    guaranteed = guarantees(budget, quotas, [*present, requester])
    over = {ns for ns in present if usage[ns] > guaranteed[ns]}
    return over | {requester}
