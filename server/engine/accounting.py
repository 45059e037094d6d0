"""Per-tenant counters and the trace of one request (what stats, metrics and tests read)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class TenantCounters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    vision_queries: int = 0
    vision_hits: int = 0
    encoder_runs: int = 0
    cached_tokens_ssd: int = 0  # of cached_tokens, those of blocks promoted from SSD

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class RequestTrace:
    """What one request did (tests and benchmarks read the last one)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    encoder_runs: int = 0
    vision_hits: int = 0
    stored_blocks: int = 0
    generated: list[int] = field(default_factory=list)
    prompt_ids: np.ndarray | None = None
    ttft_s: float = 0.0


def with_ratios(c: dict[str, int]) -> dict[str, Any]:
    """Counters plus the token and vision hit rates derived from them."""
    hit = c["cached_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
    vision = c["vision_hits"] / c["vision_queries"] if c["vision_queries"] else 0.0
    return {**c, "token_hit_rate": hit, "vision_hit_rate": vision}
