"""A cache directory as the offline tools see it: its model trees (each locked while a tool
works on it), its secret, and the tenants of a keys file by storage namespace.

```
 <cache_dir>/server_secret                     tenant salts -> namespaces
 <cache_dir>/ssd/<fp16>/index.sqlite3, lock    one SSD tier per model (fp16: fingerprint prefix)
 <cache_dir>/kv/<fp16>/..., vision/<fp16>/...  its files
```
A running server holds each of its model's ``lock``; a tool that cannot take it refuses to
touch that tree (``CacheInUse``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kv_cache.tiers.ssd_files import SsdTierBusyError, lock_tier
from kv_cache.tiers.ssd_index import SsdIndex
from kv_cache.tiers.ssd_layout import SsdLayout
from tenancy.keys import TenantEntry, load_keys_file
from tenancy.secret import read_secret
from tenancy.tenants import Tenant, make_tenant, validate_tenant_id


class OfflineError(RuntimeError):
    """A tool cannot run on this cache directory (message for the user)."""


class CacheInUse(OfflineError):
    """A server holds the SSD tier lock of a model tree."""


@dataclass(frozen=True, slots=True)
class ModelTree:
    """One model's SSD tier in the cache directory, open and locked.

    Attributes:
        name: The fingerprint prefix naming its directories.
        layout: Its paths.
        index: Its index (open).
    """

    name: str
    layout: SsdLayout
    index: SsdIndex


def model_names(cache_dir: Path) -> list[str]:
    """Fingerprint prefixes of the model trees that have an index, sorted."""
    root = Path(cache_dir) / "ssd"
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [name for name in names if (root / name / "index.sqlite3").is_file()]


@contextmanager
def open_trees(cache_dir: Path) -> Iterator[list[ModelTree]]:
    """Lock and open every model tree of a cache directory (all or none).

    Raises:
        OfflineError: ``cache_dir`` is not a directory.
        CacheInUse: A server holds one of the locks (nothing is touched then).
    """
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        raise OfflineError(f"{cache_dir} is not a directory")
    locks: list[int] = []
    trees: list[ModelTree] = []
    try:
        for name in model_names(cache_dir):
            layout = SsdLayout(cache_dir, name)
            try:
                locks.append(lock_tier(layout.lock_path))
            except SsdTierBusyError:
                raise CacheInUse(
                    f"refusing to touch {cache_dir}: a running server holds the SSD tier lock "
                    f"{layout.lock_path} (model {name}); stop the server first"
                ) from None
            trees.append(ModelTree(name, layout, SsdIndex(layout.index_path)))
        yield trees
    finally:
        for tree in trees:
            tree.index.close()
        for fd in locks:
            os.close(fd)


def keys_tenants(cache_dir: Path, keys_file: Path | None) -> dict[str, Tenant]:
    """The keys file's tenants by storage namespace (empty without a keys file)."""
    if keys_file is None:
        return {}
    secret = _secret(cache_dir)
    entries: tuple[TenantEntry, ...] = load_keys_file(keys_file)
    tenants = [make_tenant(secret, e.tenant_id, is_admin=e.is_admin, settings=e.settings) for e in entries]
    return {tenant.namespace: tenant for tenant in tenants}


def tenant_namespace(cache_dir: Path, tenant_id: str, keys_file: Path | None) -> str:
    """The storage namespace of a tenant id under this cache directory's secret.

    With a keys file the tenant must be declared in it (a typo must not silently match nothing);
    without one, any valid id is mapped (e.g. a tenant since removed from the keys file).

    Raises:
        OfflineError: An invalid id, a missing secret, or an id the keys file does not declare.
    """
    try:
        validate_tenant_id(tenant_id)
    except ValueError as exc:
        raise OfflineError(str(exc)) from None
    if keys_file is not None:
        for namespace, tenant in keys_tenants(cache_dir, keys_file).items():
            if tenant.tenant_id == tenant_id:
                return namespace
        raise OfflineError(f"tenant {tenant_id!r} is not declared in {keys_file}")
    return make_tenant(_secret(cache_dir), tenant_id).namespace


def _secret(cache_dir: Path) -> bytes:
    try:
        return read_secret(cache_dir)
    except FileNotFoundError as exc:
        raise OfflineError(str(exc)) from None
