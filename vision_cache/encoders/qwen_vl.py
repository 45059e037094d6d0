"""Qwen2-VL / Qwen2.5-VL / Qwen3.5 vision towers (dynamic resolution, 2x2 patch merge)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from PIL import Image

from vision_cache.encoders.base import ImageLayout


class Qwen2VLEncoder:
    """Qwen2-VL: ``vision_tower(pixel_values, grid_thw)`` returns merged features directly."""

    def __init__(self, model: Any, processor: Any) -> None:
        self._model = model
        self._ip = processor.image_processor
        self._merge = int(self._ip.merge_size)
        self._patch = int(self._ip.patch_size)

    def layout(self, image: Image.Image) -> ImageLayout:
        # The processor's own size resolution, so the count equals what preprocessing gives.
        h, w = self._ip._resolved_size(image.height, image.width)
        grid = (1, h // self._patch, w // self._patch)
        return ImageLayout(num_tokens=grid[1] * grid[2] // self._merge**2, grid_thw=grid)

    def _pixels(self, image: Image.Image) -> tuple[mx.array, mx.array]:
        out = self._ip(images=[image])
        pixel_values = mx.array(np.asarray(out["pixel_values"], dtype=np.float32))
        grid = mx.array(np.asarray(out["image_grid_thw"], dtype=np.int64))
        return pixel_values, grid

    def _tower(self, pixel_values: mx.array, grid: mx.array) -> mx.array:
        return self._model.vision_tower(pixel_values, grid, output_hidden_states=False)

    def encode(self, image: Image.Image) -> mx.array:
        pixel_values, grid = self._pixels(image)
        dtype = self._model.vision_tower.patch_embed.proj.weight.dtype
        feats = self._tower(pixel_values.astype(dtype), grid)
        expected = self.layout(image).num_tokens
        if feats.shape[0] != expected:
            raise RuntimeError(f"vision tower gave {feats.shape[0]} features, expected {expected}")
        return feats


class Qwen35Encoder(Qwen2VLEncoder):
    """Qwen3.5: the tower returns (features, deepstack features); no deepstack is used."""

    def _tower(self, pixel_values: mx.array, grid: mx.array) -> mx.array:
        feats, _ = self._model.vision_tower(pixel_values, grid)
        return feats
