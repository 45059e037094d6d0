"""Gemma 3 vision tower: SigLIP + average-pooling projector, fixed tokens per image."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from PIL import Image

from vision_cache.encoders.base import ImageLayout


class Gemma3Encoder:
    def __init__(self, model: Any, processor: Any) -> None:
        self._model = model
        self._ip = processor.image_processor
        self._tokens = int(model.config.text_config.mm_tokens_per_image)
        # Gemma3 scales inputs_embeds by sqrt(hidden) inside the language model; mlx-vlm's
        # merge divides the image features by the same factor so they enter unscaled.
        self._scale = float(model.config.text_config.hidden_size) ** -0.5

    def layout(self, image: Image.Image) -> ImageLayout:
        return ImageLayout(num_tokens=self._tokens, grid_thw=None)

    def encode(self, image: Image.Image) -> mx.array:
        out = self._ip(images=[image])
        pixel_values = mx.array(np.asarray(out["pixel_values"], dtype=np.float32))
        hidden, _, _ = self._model.vision_tower(
            pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True
        )
        feats = self._model.multi_modal_projector(hidden)[0]
        if feats.shape[0] != self._tokens:
            raise RuntimeError(f"vision tower gave {feats.shape[0]} features, expected {self._tokens}")
        return feats * self._scale
