"""Per-architecture prompt facts: image placeholder expansion and rope positions.

The chat template emits one *marker* per image (Qwen: ``<|image_pad|>`` between
``<|vision_start|>``/``<|vision_end|>``; Gemma 3: ``<start_of_image>``). The prompt builder asks
the architecture to expand each marker into the run of placeholder tokens the vision features
replace, and (Qwen M-RoPE) for 3-D position ids of the whole prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from vision_cache.encoders import ImageLayout


@dataclass(frozen=True, slots=True)
class Expansion:
    """Tokens replacing one image marker; the placeholder run is tokens[offset:offset+n]."""

    tokens: tuple[int, ...]
    offset: int
    num_placeholders: int


@dataclass(frozen=True, slots=True)
class Positions:
    """Explicit rope positions for the whole prompt (M-RoPE) and the decode delta."""

    position_ids: mx.array  # (3, 1, prompt_len)
    rope_delta: int


class Architecture(Protocol):
    marker_id: int
    # Token ids that may enter a prompt only through image expansion, because the model
    # derives positions from them (Qwen M-RoPE scans for vision-start/image tokens). A spliced
    # reply (ReplyLedger) containing one is re-tokenized as text instead.
    reserved_ids: frozenset[int]

    def expand(self, layout: ImageLayout) -> Expansion: ...

    def positions(self, input_ids: np.ndarray, layouts: Sequence[ImageLayout]) -> Positions | None:
        """Rope positions for the prompt, or None when the model derives them from offsets."""
        ...

    def decode_positions(self, positions: Positions | None, start: int, count: int) -> mx.array | None:
        """Positions for tokens [start, start+count) past the end of the prompt."""
        ...


class QwenArchitecture:
    """Qwen2-VL, Qwen2.5-VL, Qwen3.5: ``<|image_pad|>`` repeated, M-RoPE positions."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        cfg = model.config
        self.marker_id = int(cfg.image_token_id if hasattr(cfg, "image_token_id") else cfg.image_token_index)
        vision_ids = {self.marker_id}
        for name in ("video_token_id", "video_token_index", "vision_start_token_id", "vision_end_token_id"):
            value = getattr(cfg, name, None)
            if isinstance(value, int):
                vision_ids.add(value)
        self.reserved_ids = frozenset(vision_ids)
        self._lm = model.language_model

    def expand(self, layout: ImageLayout) -> Expansion:
        return Expansion((self.marker_id,) * layout.num_tokens, 0, layout.num_tokens)

    def positions(self, input_ids: np.ndarray, layouts: Sequence[ImageLayout]) -> Positions:
        ids = mx.array(input_ids.astype(np.int32))[None]
        grids = None
        if layouts:
            grids = mx.array(np.array([l.grid_thw for l in layouts], dtype=np.int64))
        position_ids, deltas = self._lm.get_rope_index(ids, grids, None, None)
        return Positions(position_ids=position_ids, rope_delta=int(deltas.reshape(-1)[0].item()))

    def decode_positions(self, positions: Positions | None, start: int, count: int) -> mx.array:
        delta = positions.rope_delta if positions is not None else 0
        pos = mx.arange(start + delta, start + delta + count).reshape(1, 1, count)
        return mx.broadcast_to(pos, (3, 1, count))


class Gemma3Architecture:
    """Gemma 3: ``<start_of_image>`` becomes ``\\n\\n<boi> <image>*N <eoi>\\n\\n``; 1-D rope."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        cfg = model.config
        self.marker_id = int(tokenizer.convert_tokens_to_ids(tokenizer.boi_token))
        self._image_id = int(cfg.image_token_index)
        self._eoi_id = int(tokenizer.convert_tokens_to_ids(tokenizer.eoi_token))
        self._newlines = tuple(tokenizer.encode("\n\n", add_special_tokens=False))
        # Image features are placed by span and positions come from cache offsets, so no id
        # changes how a prompt is read.
        self.reserved_ids: frozenset[int] = frozenset()

    def expand(self, layout: ImageLayout) -> Expansion:
        n = layout.num_tokens
        nl = self._newlines
        tokens = nl + (self.marker_id,) + (self._image_id,) * n + (self._eoi_id,) + nl
        return Expansion(tokens, len(nl) + 1, n)

    def positions(self, input_ids: np.ndarray, layouts: Sequence[ImageLayout]) -> None:
        return None

    def decode_positions(self, positions: Positions | None, start: int, count: int) -> None:
        return None


ArchitectureFactory = Callable[[Any, Any], Architecture]

ARCHITECTURES: Mapping[str, ArchitectureFactory] = {
    "qwen2_vl": QwenArchitecture,
    "qwen2_5_vl": QwenArchitecture,
    "qwen3_5": QwenArchitecture,
    "gemma3": Gemma3Architecture,
}


def architecture_for(model_type: str, model: Any, tokenizer: Any) -> Architecture:
    try:
        factory = ARCHITECTURES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
    return factory(model, tokenizer)
