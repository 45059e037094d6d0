"""Engine settings: what the engine needs from the server configuration."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """Settings of the model engine and its caches.

    Attributes:
        model_path: directory of an mlx-vlm model (a built fixture or a converted model).
        cache_dir: root of the on-disk state (server secret, SSD tier).
        block_size: tokens per KV block (the unit of hashing and reuse).
        prefill_chunk: tokens per prefill step; rounded down to a multiple of block_size.
        ram_budget_bytes: KV RAM tier budget; None = 20% of available RAM, at least 100 MB.
        vision_budget_bytes: vision-feature cache budget; None = 1/8 of the KV budget.
        max_tokens_default: completion length when the request names none.
        hit_rate_warn_threshold: rolling prefix-cache block hit rate below which one warning
            names the dominant miss reason (0 disables).
        hit_rate_window: requests in that rolling window.
    """

    model_path: Path
    cache_dir: Path
    block_size: int = 64
    prefill_chunk: int = 512
    ram_budget_bytes: int | None = None
    vision_budget_bytes: int | None = None
    max_tokens_default: int = 256
    ssd_enabled: bool = True
    ssd_budget_bytes: int = 10 * 2**30
    ssd_queue_size: int = 64
    hit_rate_warn_threshold: float = 0.2
    hit_rate_window: int = 50

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit_rate_warn_threshold <= 1.0:
            raise ValueError(
                f"hit_rate_warn_threshold must be in [0, 1], got {self.hit_rate_warn_threshold}")
        if self.hit_rate_window < 1:
            raise ValueError(f"hit_rate_window must be >= 1, got {self.hit_rate_window}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.prefill_chunk < self.block_size:
            raise ValueError(
                f"prefill_chunk ({self.prefill_chunk}) must be >= block_size ({self.block_size})"
            )
        if self.ssd_budget_bytes < 0:
            raise ValueError(f"ssd_budget_bytes must be >= 0, got {self.ssd_budget_bytes}")
        if self.ssd_queue_size < 1:
            raise ValueError(f"ssd_queue_size must be >= 1, got {self.ssd_queue_size}")
