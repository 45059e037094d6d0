"""Where the SSD tier keeps things under the cache directory.

```
 <cache_dir>/kv/<fp16>/<namespace>/<hh>/<hh>/<block hash>.safetensors     KV blocks
 <cache_dir>/vision/<fp16>/<namespace>/<hh>/<hh>/<image hash>.safetensors vision features
 <cache_dir>/ssd/<fp16>/index.sqlite3 (+ -wal, -shm), lock                 index, process lock
 <cache_dir>/quarantine/<kind>-<key>-<time ns>.safetensors                 files that failed
```
``fp16`` is the first 16 hex digits of the model fingerprint; ``namespace`` is the tenant's
storage namespace (a digest of its salt, never the tenant id); ``hh/hh`` are the first two
bytes of the key in hex, so no directory grows past 256 entries per level before the leaves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kv_cache.tiers.ssd_index import RecordKind

FILE_SUFFIX = ".safetensors"
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_KEY_RE = re.compile(r"[0-9a-f]{2,128}")


def check_namespace(namespace: str) -> str:
    """Raise ValueError unless ``namespace`` is safe as one directory name."""
    if not isinstance(namespace, str) or _NAMESPACE_RE.fullmatch(namespace) is None:
        raise ValueError(f"invalid storage namespace {namespace!r}: use 1-64 of A-Z a-z 0-9 _ -")
    return namespace


@dataclass(frozen=True, slots=True)
class SsdLayout:
    """Paths of one model's SSD tier.

    Attributes:
        cache_dir: The cache root.
        fingerprint: The model fingerprint (its first 16 characters name the model's trees).
    """

    cache_dir: Path
    fingerprint: str

    @property
    def model_dir(self) -> str:
        name = self.fingerprint[:16]
        if _KEY_RE.fullmatch(name) is None and _NAMESPACE_RE.fullmatch(name) is None:
            raise ValueError(f"model fingerprint {self.fingerprint!r} is not a safe directory name")
        return name

    def tree(self, kind: RecordKind) -> Path:
        """Root of one record kind's files for this model."""
        return self.cache_dir / kind.value / self.model_dir

    @property
    def index_path(self) -> Path:
        return self.cache_dir / "ssd" / self.model_dir / "index.sqlite3"

    @property
    def lock_path(self) -> Path:
        return self.cache_dir / "ssd" / self.model_dir / "lock"

    @property
    def quarantine_dir(self) -> Path:
        return self.cache_dir / "quarantine"

    def path(self, kind: RecordKind, namespace: str, key: bytes) -> Path:
        """The file of one record."""
        name = key.hex()
        return self.tree(kind) / check_namespace(namespace) / name[:2] / name[2:4] / (name + FILE_SUFFIX)

    def parse(self, kind: RecordKind, path: Path) -> tuple[str, bytes] | None:
        """``(namespace, key)`` of a path that is exactly where ``path()`` puts a record."""
        try:
            relative = path.relative_to(self.tree(kind))
        except ValueError:
            return None
        parts = relative.parts
        if len(parts) != 4 or not parts[3].endswith(FILE_SUFFIX):
            return None
        namespace, first, second, filename = parts
        name = filename[: -len(FILE_SUFFIX)]
        if (
            _NAMESPACE_RE.fullmatch(namespace) is None
            or _KEY_RE.fullmatch(name) is None
            or len(name) % 2
            or (first, second) != (name[:2], name[2:4])
        ):
            return None
        return namespace, bytes.fromhex(name)
