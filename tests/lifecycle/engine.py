"""Engine factories for the tenancy-lifecycle tests: runners on the tiny qwen2_vl fixture with
an SSD tier in a test directory and an injectable wall clock, tenants with settings, and
scans of a cache directory."""

from __future__ import annotations

import os
from pathlib import Path

from kv_cache.hashing import BlockHash
from kv_cache.tiers.ssd_index import RecordKind
from server.engine.runner import ModelRunner
from tenancy.tenants import Tenant, TenantSettings, make_tenant
from tests.engine.conftest import SECRET
from tests.lifecycle.factories import Clock
from tests.ssd.factories import make_runner as make_ssd_runner

FAMILY = "qwen2_vl"
SYSTEM = ("You are the careful assistant of a shipping company. Answer briefly, politely, and "
          "always mention the parcel number you were asked about.")


def make_runner(
    cache_dir: Path | None,
    *,
    clock: Clock | None = None,
    ram_budget_bytes: int = 256 << 20,
    ssd_budget_bytes: int = 1 << 30,
) -> ModelRunner:
    """A runner on the tiny fixture; ``cache_dir`` None means RAM only."""
    return make_ssd_runner(
        FAMILY, cache_dir, clock=clock, ram_budget_bytes=ram_budget_bytes,
        ssd_budget_bytes=ssd_budget_bytes,
    )


def tenant(name: str, **settings: object) -> Tenant:
    return make_tenant(SECRET, name, settings=TenantSettings(**settings))  # type: ignore[arg-type]


def spill_resident(runner: ModelRunner) -> None:
    """Write a copy of every resident block to the SSD tier (as a shutdown would)."""
    assert runner.ssd is not None
    for block in list(runner.prefix_cache.pool):
        runner.ssd.spill(block, wait=True)
    runner.ssd.flush()


def block_owners(runner: ModelRunner, namespace: str) -> dict[BlockHash, set[str]]:
    """Owners of every KV block of a tenant over RAM and SSD."""
    out: dict[BlockHash, set[str]] = {}
    for block in runner.prefix_cache.pool:
        if block.namespace == namespace:
            out.setdefault(block.block_hash, set()).update(block.owners)
    if runner.ssd is not None:
        for row in runner.ssd.rows(RecordKind.KV):
            if row.namespace == namespace:
                out.setdefault(BlockHash(row.key), set()).update(row.owners)
    return out


def file_names(cache_dir: Path) -> list[str]:
    return sorted(name for _, _, names in os.walk(cache_dir) for name in names)


def raw_bytes(cache_dir: Path) -> bytes:
    """Every byte of every file under the cache directory (safetensors, index, WAL, ...)."""
    chunks = []
    for directory, _, names in os.walk(cache_dir):
        for name in names:
            chunks.append((Path(directory) / name).read_bytes())
    return b"\0".join(chunks)
