"""Chat messages -> token ids with image spans, tokenizing message text as plain text.

The chat template is rendered with a sentinel in place of every text part, and the rendered
string is cut at the sentinels:

```
 template piece | text 0 | template piece | text 1 | ... | template piece
 (special tokens parsed)   (special-token strings stay plain text)
```

so ``<|im_start|>`` typed by a user is tokenized as ordinary characters: no forged turns, and no
way to desynchronise image placeholders from image features. Image markers inside template
pieces are expanded by the architecture into placeholder runs whose spans are recorded.

An assistant message whose text is exactly a reply this server generated for the same tenant is
re-inserted as the generated token ids (``ReplyLedger``), so the next turn matches the cached
KV of the reply token for token even where detokenize -> retokenize is not the identity.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kv_cache.hashing import ImageSpan
from server.engine.architectures import Architecture
from server.engine.types import ChatMessage, ImagePart, TextPart
from vision_cache.encoders import ImageLayout, VisionEncoder
from vision_cache.hashing import ImageHash

# Private-use code points: never produced by chat templates, never special tokens.
_SENTINEL_OPEN, _SENTINEL_CLOSE = "\ue000", "\ue001"
_SENTINEL_RE = re.compile(f"{_SENTINEL_OPEN}(\\d+){_SENTINEL_CLOSE}")


class PromptError(ValueError):
    """The messages cannot be turned into a prompt (reported to the client as 400)."""


@dataclass(frozen=True, slots=True)
class PromptImage:
    part: ImagePart
    layout: ImageLayout
    span: ImageSpan


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    """A tokenized prompt.

    Attributes:
        token_ids: int32, shape (n,).
        images: each image with its layout and placeholder span, in order.
        text_starts: where each message text begins: where two prompts sharing a history most
            often start to differ (a new question, another user's turn).
    """

    token_ids: np.ndarray
    images: tuple[PromptImage, ...]
    text_starts: tuple[int, ...] = ()

    @property
    def spans(self) -> tuple[ImageSpan, ...]:
        return tuple(img.span for img in self.images)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


class ReplyLedger:
    """Bounded map (tenant namespace, reply text) -> the token ids generated for it."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError(f"ReplyLedger capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    @staticmethod
    def _key(namespace: str, text: str) -> bytes:
        return xxhash.xxh3_128_digest(namespace.encode() + b"\0" + text.encode("utf-8"))

    def record(self, namespace: str, text: str, token_ids: Sequence[int]) -> None:
        if not text:
            return
        key = self._key(namespace, text)
        self._entries[key] = tuple(int(t) for t in token_ids)
        self._entries.move_to_end(key)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)

    def get(self, namespace: str, text: str) -> tuple[int, ...] | None:
        key = self._key(namespace, text)
        ids = self._entries.get(key)
        if ids is not None:
            self._entries.move_to_end(key)
        return ids

    def __len__(self) -> int:
        return len(self._entries)


class PromptBuilder:
    def __init__(
        self,
        tokenizer: Any,
        architecture: Architecture,
        encoder: VisionEncoder,
        ledger: ReplyLedger,
    ) -> None:
        self._tok = tokenizer
        self._arch = architecture
        self._encoder = encoder
        self._ledger = ledger
        # The fast tokenizer's backend encodes special-token strings as plain text when
        # ``encode_special_tokens`` is set; keep one backend per mode instead of toggling.
        backend = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer._tokenizer
        self._special = backend
        self._plain = backend.__class__.from_str(backend.to_str())
        self._plain.encode_special_tokens = True

    def _encode_template(self, text: str) -> list[int]:
        return self._special.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """Tokenize user-supplied text: special-token strings stay ordinary characters."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def build(self, messages: Sequence[ChatMessage], namespace: str) -> BuiltPrompt:
        """Render and tokenize a conversation, ending with the assistant generation prompt."""
        if not messages:
            raise PromptError("messages must not be empty")
        texts: list[tuple[str, str]] = []  # (role, text) per sentinel index
        images: list[ImagePart] = []
        template_messages: list[dict[str, Any]] = []
        for msg in messages:
            parts: list[dict[str, str]] = []
            for part in msg.parts:
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": f"{_SENTINEL_OPEN}{len(texts)}{_SENTINEL_CLOSE}"})
                    texts.append((msg.role, part.text))
                else:
                    parts.append({"type": "image"})
                    images.append(part)
            if len(parts) == 1 and parts[0]["type"] == "text":
                template_messages.append({"role": msg.role, "content": parts[0]["text"]})
            else:
                template_messages.append({"role": msg.role, "content": parts})
        try:
            rendered = self._tok.apply_chat_template(
                template_messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja raises for role orders the template rejects
            raise PromptError(f"chat template rejected the messages: {exc}") from exc

        pieces = _SENTINEL_RE.split(rendered)
        # split() alternates template text and captured sentinel indices.
        order = [int(i) for i in pieces[1::2]]
        if order != list(range(len(texts))):
            raise PromptError("chat template dropped or reordered message text")

        layouts = [self._encoder.layout(p.image) for p in images]
        ids: list[int] = []
        prompt_images: list[PromptImage] = []
        text_starts: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 1:
                role, text = texts[int(piece)]
                text_starts.append(len(ids))
                ids.extend(self._text_ids(role, text, namespace))
                continue
            for tok in self._encode_template(piece):
                if tok != self._arch.marker_id:
                    ids.append(tok)
                    continue
                n = len(prompt_images)
                if n >= len(images):
                    raise PromptError("chat template emitted more image markers than images")
                exp = self._arch.expand(layouts[n])
                start = len(ids) + exp.offset
                ids.extend(exp.tokens)
                span = ImageSpan(ImageHash(images[n].image_hash), start, start + exp.num_placeholders)
                prompt_images.append(PromptImage(images[n], layouts[n], span))
        if len(prompt_images) != len(images):
            raise PromptError(
                f"chat template placed {len(prompt_images)} image markers for {len(images)} images"
            )
        return BuiltPrompt(np.asarray(ids, dtype=np.int32), tuple(prompt_images), tuple(text_starts))

    def _text_ids(self, role: str, text: str, namespace: str) -> list[int]:
        if role == "assistant":
            ids = self._ledger.get(namespace, text)
            if ids is not None and not self._arch.reserved_ids.intersection(ids):
                return list(ids)
        return self.encode_plain(text)
