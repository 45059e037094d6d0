"""What the engine needs from a vision tower: a token layout per image and its features."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from PIL import Image


@dataclass(frozen=True, slots=True)
class ImageLayout:
    """How one image appears in the language model's input.

    Attributes:
        num_tokens: placeholder tokens the image occupies in input_ids.
        grid_thw: (t, h, w) patch grid before merging (Qwen M-RoPE positions need it);
            None for architectures without a grid (fixed token count).
    """

    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None


class VisionEncoder(Protocol):
    """Turns images into projected features ready to replace placeholder embeddings."""

    def layout(self, image: Image.Image) -> ImageLayout:
        """Token layout from the image size alone (no pixel work)."""
        ...

    def encode(self, image: Image.Image) -> mx.array:
        """Run the vision tower (+ projector) on one image: (num_tokens, hidden) features,
        already scaled as the language model expects them in ``inputs_embeds``."""
        ...


class UnsupportedArchitectureError(ValueError):
    """No vision encoder adapter for this model_type."""


EncoderFactory = Callable[[Any, Any], VisionEncoder]


def _registry() -> dict[str, EncoderFactory]:
    from vision_cache.encoders.gemma3 import Gemma3Encoder
    from vision_cache.encoders.qwen_vl import Qwen2VLEncoder, Qwen35Encoder

    return {
        "qwen2_vl": Qwen2VLEncoder,
        "qwen2_5_vl": Qwen2VLEncoder,
        "qwen3_5": Qwen35Encoder,
        "gemma3": Gemma3Encoder,
    }


ENCODERS: Mapping[str, EncoderFactory] = _registry()


def encoder_for(model_type: str, model: Any, processor: Any) -> VisionEncoder:
    """Build the encoder adapter for a loaded mlx-vlm model."""
    try:
        factory = ENCODERS[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} has no vision encoder adapter "
            f"(supported: {', '.join(sorted(ENCODERS))})"
        ) from None
    return factory(model, processor)
