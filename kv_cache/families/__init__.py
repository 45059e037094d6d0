"""Cache-family adapters: how each mlx cache class is harvested into blocks and rebuilt.

```
 live cache (one per layer)            blocks in kv_cache
 KVCache         keys[0:offset] ---->  LayerSlice per block (K,V of its positions)
 RotatingKVCache ring of last W  ---->  LayerSlice per block, cut while still in the ring
 ArraysCache     recurrent state ---->  Checkpoint at chosen lengths only
```
"""

from kv_cache.families.base import (
    CacheFamily,
    LayerCheckpoint,
    LayerSlice,
    family_for,
    family_registry,
)

__all__ = ["CacheFamily", "LayerCheckpoint", "LayerSlice", "family_for", "family_registry"]
