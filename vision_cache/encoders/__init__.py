"""Vision-encoder adapters, one per architecture, behind a registry keyed by model_type."""

from vision_cache.encoders.base import (
    ENCODERS,
    ImageLayout,
    UnsupportedArchitectureError,
    VisionEncoder,
    encoder_for,
)

__all__ = ["ENCODERS", "ImageLayout", "UnsupportedArchitectureError", "VisionEncoder", "encoder_for"]
