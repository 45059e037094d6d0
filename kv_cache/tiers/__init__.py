"""Storage tiers of the KV cache (RAM now; SSD and Redis later)."""

from __future__ import annotations

from kv_cache.tiers.ram import RamTier, default_ram_budget

__all__ = ["RamTier", "default_ram_budget"]
