"""Token selection: greedy, or temperature + nucleus (top-p) sampling with an optional seed."""

from __future__ import annotations

import mlx.core as mx

from server.engine.types import SamplingParams


class Sampler:
    """Picks the next token from last-position logits.

    A seeded sampler draws from its own key chain, so the same seed gives the same tokens
    regardless of what other requests did before.
    """

    def __init__(self, params: SamplingParams) -> None:
        if params.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        self._temperature = params.temperature
        self._top_p = params.top_p
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    @property
    def greedy(self) -> bool:
        return self._temperature == 0

    def __call__(self, logits: mx.array) -> mx.array:
        """logits: (vocab,) float -> scalar int32 token id (lazy)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1)
        logits = logits.astype(mx.float32) / self._temperature
        if self._top_p < 1.0:
            logits = _nucleus(logits, self._top_p)
        if self._key is not None:
            self._key, sub = mx.random.split(self._key)
            return mx.random.categorical(logits, key=sub)
        return mx.random.categorical(logits)


def _nucleus(logits: mx.array, top_p: float) -> mx.array:
    """Mask all tokens outside the smallest set whose probability mass reaches top_p."""
    order = mx.argsort(-logits, axis=-1)
    sorted_logits = mx.take_along_axis(logits, order, axis=-1)
    probs = mx.softmax(sorted_logits, axis=-1)
    # Keep a token if the mass *before* it is still below top_p (the top token always stays).
    before = mx.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    masked_sorted = mx.where(keep_sorted, sorted_logits, -mx.inf)
    inverse = mx.argsort(order, axis=-1)
    return mx.take_along_axis(masked_sorted, inverse, axis=-1)
