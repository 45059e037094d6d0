"""Reusable-token ceilings of a replay, tokenized by this server's own prompt builder.

The ceiling of a request is the longest common prefix of its prompt with anything the same
tenant sent or received earlier (``CeilingHistory``): an earlier prompt, or an earlier prompt
followed by its fixed reply (the definition of ``fixtures.conversation``), capped at
``prompt - 1`` since the last prompt token must be computed. Image placeholders match only for
the same picture.

It needs the model's tokenizer, chat template and image layout, so it is available when the
benchmarked endpoint serves a model we can load here (a built fixture, or ``--ceiling-model``).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fixtures.conversation import common_prefix_length
from server.bench.replay import Message, SentImage, TurnRequest, with_reply
from server.engine.architectures import architecture_for
from server.engine.prompt import BuiltPrompt, PromptBuilder, ReplyLedger
from server.engine.types import ChatMessage, ImagePart, TextPart
from vision_cache.encoders import encoder_for
from vision_cache.hashing import image_hash

_SALT = b"vlmcache-bench-ceiling"
_NAMESPACE = "bench"
_FIXTURE_NAME = re.compile(r"^(?P<family>[a-z0-9_]+?)-(?P<preset>[a-z]+)(?:-|$)")


@dataclass(frozen=True, slots=True)
class Ceiling:
    """Attributes:
    prompt_tokens: The prompt's length by this server's prompt builder.
    reusable_tokens: The ceiling.
    """

    prompt_tokens: int
    reusable_tokens: int


def fixture_of(model_name: str) -> tuple[str, str] | None:
    """``(family, preset)`` if a served model name names a fixture (``qwen2_vl-bench``, or a
    fixture directory such as ``.../qwen2_vl-bench-v1-85ee...``), else None."""
    from fixtures.build import FAMILIES, PRESETS

    match = _FIXTURE_NAME.match(Path(model_name).name)
    if match is None:
        return None
    family, preset = match["family"], match["preset"]
    return (family, preset) if family in FAMILIES and preset in PRESETS else None


class CeilingCalculator:
    """Tokenizes replays with the prompt builder of one local model.

    Args:
        model_dir: An mlx-vlm model directory (weights are loaded: the image layout and rope
            facts come from the model objects).
    """

    def __init__(self, model_dir: Path) -> None:
        from server.engine.model import load_model

        loaded = load_model(Path(model_dir), block_size=64)
        self._tokenizer = loaded.tokenizer
        architecture = architecture_for(loaded.model_type, loaded.model, loaded.tokenizer)
        encoder = encoder_for(loaded.model_type, loaded.model, loaded.processor)
        self._builder = PromptBuilder(loaded.tokenizer, architecture, encoder, ReplyLedger())
        self._generation_suffix = self._suffix_ids()
        self.model_dir = Path(model_dir)

    def history(self) -> CeilingHistory:
        """A fresh history: what one tenant of one server has been sent so far."""
        return CeilingHistory(self)

    def sequences(self, request: TurnRequest) -> tuple[tuple[Hashable, ...], tuple[Hashable, ...]]:
        """The request's prompt keys, and those of the prompt followed by its fixed reply."""
        prompt = _keys(self._builder.build(_chat(request.messages), _NAMESPACE))
        replied = _keys(self._builder.build(_chat(with_reply(request)), _NAMESPACE))
        suffix = self._generation_suffix
        if suffix and replied[-len(suffix):] == suffix:
            replied = replied[: -len(suffix)]
        return prompt, replied

    def _suffix_ids(self) -> tuple[int, ...]:
        """Tokens the template appends for ``add_generation_prompt`` (the builder always adds
        them; a prompt + reply rendering must end without them)."""
        probe = [{"role": "user", "content": "x"}]
        with_prompt = self._tokenizer.apply_chat_template(probe, tokenize=False,
                                                         add_generation_prompt=True)
        without = self._tokenizer.apply_chat_template(probe, tokenize=False,
                                                     add_generation_prompt=False)
        if not with_prompt.startswith(without):
            return ()
        return tuple(self._tokenizer.encode(with_prompt[len(without):], add_special_tokens=False))


def _chat(messages: Sequence[Message]) -> list[ChatMessage]:
    return [
        ChatMessage(m.role, tuple(  # type: ignore[arg-type]
            TextPart(p) if isinstance(p, str) else _image(p) for p in m.parts))
        for m in messages
    ]


def _image(sent: SentImage) -> ImagePart:
    return ImagePart(sent.image, image_hash(_SALT, sent.image))


def _keys(prompt: BuiltPrompt) -> tuple[Hashable, ...]:
    """Token ids, with each image placeholder keyed by (image hash, offset)."""
    keys: list[Hashable] = [int(t) for t in prompt.token_ids]
    for span in prompt.spans:
        for offset in range(span.end - span.start):
            keys[span.start + offset] = (span.image_hash, offset)
    return tuple(keys)


class CeilingHistory:
    """Everything one tenant sent a server during a bench run, in order.

    A server may reuse anything the tenant sent before, not only earlier turns of the same
    replay (the warm-up request, other replays: at least the chat template's role header), so
    ceilings are taken against the whole history.
    """

    def __init__(self, calculator: CeilingCalculator) -> None:
        self._calculator = calculator
        self._seen: list[tuple[Hashable, ...]] = []

    def add(self, request: TurnRequest) -> Ceiling:
        """The request's ceiling against the history; then the request joins the history."""
        prompt, replied = self._calculator.sequences(request)
        best = max((common_prefix_length(prompt, earlier) for earlier in self._seen), default=0)
        self._seen += [prompt, replied]
        return Ceiling(len(prompt), min(best, len(prompt) - 1))
