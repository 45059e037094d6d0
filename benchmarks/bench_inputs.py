"""Deterministic prompt text, pictures and a timed engine call shared by the benchmark scripts
(run from the repo root as ``python benchmarks/<script>.py``, which puts this folder on
``sys.path``)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from PIL import Image, ImageDraw

from server.engine.runner import ModelRunner
from server.engine.types import ChatMessage, EngineError, GenerationRequest, SamplingParams
from tenancy.tenants import Tenant

WORDS = (
    "the system keeps every block of computed attention state so that later turns of a "
    "conversation start from where the previous turn ended instead of from the first token "
).split()


def text_of(n_words: int, seed: int) -> str:
    """``n_words`` words; different seeds give different word orders."""
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def picture(seed: int = 0) -> Image.Image:
    """A 224 px picture of bars; different seeds give different pixels."""
    img = Image.new("RGB", (224, 224), ((40 + seed * 40) % 256, 90, 160))
    d = ImageDraw.Draw(img)
    for k in range(6):
        d.rectangle([10 + 30 * k, 20 + seed, 30 + 30 * k, 200 - 10 * k], fill=(255 - 30 * k, 40 * k % 256, 80))
    return img


def time_to_first_token(runner: ModelRunner, tenant: Tenant, messages: Sequence[ChatMessage]) -> float:
    """Seconds of one greedy request for a single token (its TTFT); raises on an engine error."""
    events: list[object] = []
    req = GenerationRequest("bench", tenant, "bench", tuple(messages), SamplingParams(max_tokens=1))
    start = time.perf_counter()
    runner.generate(req, events.append, lambda: False)
    elapsed = time.perf_counter() - start
    errors = [e for e in events if isinstance(e, EngineError)]
    if errors:
        raise RuntimeError(errors[0].message)
    return elapsed
