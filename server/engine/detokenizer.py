"""Incremental detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

from typing import Any


class StreamingDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes the tokens since the last *settled* point (a position where the text ended in a
    complete character) so the cost per token stays small.
    """

    def __init__(self, tokenizer: Any, skip_ids: frozenset[int]) -> None:
        self._tok = tokenizer
        self._skip = skip_ids
        self._ids: list[int] = []
        self._settled_ids = 0  # ids before this index are reflected in _settled_text
        self._settled_text = ""
        self._emitted = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        if token_id not in self._skip:
            self._ids.append(token_id)
        tail = self._tok.decode(
            self._ids[self._settled_ids :],
            skip_special_tokens=True,
            clean_up_tokenization_spaces=False,
        )
        if tail.endswith("\ufffd"):
            return ""  # incomplete multi-byte character: wait for the next token
        text = self._settled_text + tail
        delta = text[len(self._emitted) :]
        self._emitted = text
        # Settle every 16 tokens so decode calls stay short.
        if len(self._ids) - self._settled_ids >= 16:
            self._settled_text = text
            self._settled_ids = len(self._ids)
        return delta

    @property
    def text(self) -> str:
        return self._emitted
