"""Conversation fixtures -> the requests of one replay, with or without reusable state.

A replay sends, for every turn of every session (in file order), the system message, the earlier
turns with their *fixed* replies, and the turn's user message (``fixtures/conversations``).

Two modes, so that the same run can measure a server with and without its caches, and any
server (this one or another) the same way:

``cache``     each replay is a fresh conversation: one nonce for the whole replay is put in
              front of the system message and into one pixel of every image. Within the replay
              everything a cache can reuse is reusable; nothing from an earlier replay is (so
              turn 1 is cold every time, also on a server that has run the bench before).
``no-cache``  a new nonce on *every request*: the prompt differs from its first tokens and
              every image from its first pixel, so no prefix-cache or vision-cache entry can be
              reused. Same prompt lengths and images as ``cache``: the honest "without cache"
              baseline for a server whose caches cannot be switched off.

``verbatim=True`` sends the fixtures unchanged (no nonce): turn 1 may then hit what an earlier
run left behind.
"""

from __future__ import annotations

import enum
import hashlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from fixtures.conversation import Conversation, ImagePart, Session, TextPart


class Mode(enum.StrEnum):
    CACHE = "cache"
    NO_CACHE = "no-cache"


@dataclass(frozen=True, slots=True)
class SentImage:
    """An image exactly as sent: its PNG bytes and the decoded picture."""

    png: bytes
    image: Image.Image

    def data_url(self) -> str:
        import base64

        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


Part = str | SentImage


@dataclass(frozen=True, slots=True)
class Message:
    """A chat message: role and its parts (system and assistant messages hold one text)."""

    role: str
    parts: tuple[Part, ...]

    def openai(self) -> dict[str, Any]:
        """OpenAI form: a string for text-only system/assistant messages, else a list of parts."""
        if self.role != "user" and all(isinstance(p, str) for p in self.parts):
            text = "".join(p for p in self.parts if isinstance(p, str))
            return {"role": self.role, "content": text}
        content = [
            {"type": "text", "text": p} if isinstance(p, str)
            else {"type": "image_url", "image_url": {"url": p.data_url()}}
            for p in self.parts
        ]
        return {"role": self.role, "content": content}


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """One request of a replay.

    Attributes:
        session_id: The fixture session (plus the replay nonce, so sessions never collide).
        turn: Turn index within the session (0-based).
        step: Index of the request within the replay (0-based, across sessions).
        messages: The request's messages.
        reply: The turn's fixed assistant reply (sent back as history by later turns).
    """

    session_id: str
    turn: int
    step: int
    messages: tuple[Message, ...]
    reply: str

    def openai_messages(self) -> list[dict[str, Any]]:
        return [m.openai() for m in self.messages]


def nonce_for(*labels: object) -> str:
    """A short deterministic nonce for a replay or a request."""
    return hashlib.sha256("/".join(str(x) for x in labels).encode()).hexdigest()[:12]


class _Images:
    """Fixture images, marked with a nonce in their top-left pixel, PNG-encoded once each."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, str | None], SentImage] = {}

    def get(self, part: ImagePart, nonce: str | None) -> SentImage:
        key = (str(part.path), nonce)
        sent = self._memo.get(key)
        if sent is None:
            sent = self._memo[key] = _mark(part, nonce)
            if len(self._memo) > 256:  # no-cache mode makes a new image per request
                self._memo.pop(next(iter(self._memo)))
        return sent


def _mark(part: ImagePart, nonce: str | None) -> SentImage:
    if nonce is None:
        data = part.path.read_bytes()
        return SentImage(data, part.load())
    image = part.load()
    digest = hashlib.sha256(nonce.encode()).digest()
    image.putpixel((0, 0), (digest[0], digest[1], digest[2]))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return SentImage(buffer.getvalue(), image)


def plan_replay(
    conversation: Conversation,
    mode: Mode,
    *,
    replay_nonce: str,
    turns: int | None = None,
    verbatim: bool = False,
) -> list[TurnRequest]:
    """The requests of one replay of ``conversation``.

    Args:
        conversation: The fixture.
        mode: ``cache`` or ``no-cache`` (see the module docstring).
        replay_nonce: Distinguishes this replay from every other (e.g. run id + repeat).
        turns: Replay at most this many turns of each session.
        verbatim: Send the fixtures unchanged (``cache`` mode only).
    """
    if verbatim and mode is Mode.NO_CACHE:
        raise ValueError("verbatim replays cannot be no-cache (they would reuse everything)")
    if turns is not None and turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    images = _Images()
    requests: list[TurnRequest] = []
    for session in conversation.sessions:
        count = len(session.turns) if turns is None else min(turns, len(session.turns))
        for turn in range(count):
            step = len(requests)
            if verbatim:
                nonce = None
            elif mode is Mode.CACHE:
                nonce = replay_nonce
            else:
                nonce = nonce_for(replay_nonce, step)
            requests.append(TurnRequest(
                session_id=(session.session_id if verbatim
                            else f"{session.session_id}-{replay_nonce}"),
                turn=turn,
                step=step,
                messages=tuple(_messages(session, turn, nonce, images)),
                reply=session.turns[turn].assistant,
            ))
    return requests


def _messages(session: Session, turn: int, nonce: str | None, images: _Images) -> Iterator[Message]:
    system = session.system_text()
    if nonce is not None:
        # In front of everything: a new nonce changes the prompt right after the template's
        # first tokens (role header), so only those few can ever be shared.
        system = nonce if system is None else f"{nonce} {system}"
    if system is not None:
        yield Message("system", (system,))
    for index, t in enumerate(session.turns[: turn + 1]):
        yield Message("user", tuple(
            p.text if isinstance(p, TextPart) else images.get(p, nonce) for p in t.user))
        if index < turn:
            yield Message("assistant", (t.assistant,))


def with_reply(request: TurnRequest) -> Sequence[Message]:
    """The request's messages followed by its fixed reply (what a cache could hold after it)."""
    return (*request.messages, Message("assistant", (request.reply,)))
