"""Factories for engine integration tests on the tiny fixtures of the three cache families."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from fixtures.build import ensure_fixture
from fixtures.conversation import ImagePart as FixtureImage
from fixtures.conversation import Session, TextPart as FixtureText
from server.engine.model import LoadedModel, load_model
from server.engine.prompt import ReplyLedger
from server.engine.accounting import RequestTrace
from server.engine.runner import ModelRunner
from server.engine.settings import EngineSettings
from server.engine.types import (
    ChatMessage,
    EngineError,
    FinishEvent,
    GenerationRequest,
    ImagePart,
    SamplingParams,
    TextPart,
    TokenEvent,
    Usage,
)
from tenancy.tenants import Tenant, make_tenant
from vision_cache.hashing import image_hash

FAMILIES = ("qwen2_vl", "gemma3", "qwen3_5")
BLOCK = 16
CHUNK = 32
SECRET = b"engine-tests-secret-0123456789ab"


@dataclass(frozen=True, slots=True)
class Result:
    tokens: list[int]
    text: str
    usage: Usage
    finish: str
    trace: RequestTrace


_LOADED: dict[str, LoadedModel] = {}


def loaded(family: str) -> LoadedModel:
    if family not in _LOADED:
        _LOADED[family] = load_model(ensure_fixture(family, "tiny"), block_size=BLOCK)
    return _LOADED[family]


def make_runner(
    family: str,
    *,
    ledger: ReplyLedger | None = None,
    block_size: int = BLOCK,
    prefill_chunk: int = CHUNK,
    ram_budget_bytes: int = 256 << 20,
) -> ModelRunner:
    model = loaded(family)
    settings = EngineSettings(
        model_path=Path("unused"),
        cache_dir=Path("unused"),
        block_size=block_size,
        prefill_chunk=prefill_chunk,
        ram_budget_bytes=ram_budget_bytes,
        ssd_enabled=False,  # RAM-only; the SSD tier has its own tests (tests/ssd)
    )
    return ModelRunner(model, settings, ledger=ledger)


def tenant(name: str = "alice") -> Tenant:
    return make_tenant(SECRET, name)


def picture(seed: int, size: tuple[int, int] = (112, 112)) -> Image.Image:
    """A small deterministic picture; different seeds give different pixels."""
    img = Image.new("RGB", size, ((seed * 53) % 256, (seed * 97) % 256, (seed * 31) % 256))
    draw = ImageDraw.Draw(img)
    draw.rectangle([seed % 20, 10, 40 + seed % 50, 70], fill=(255 - seed % 256, 20, 200))
    draw.ellipse([50, 40 + seed % 30, 100, 100], fill=(10, (seed * 7) % 256, 90))
    return img


def image_part(t: Tenant, img: Image.Image) -> ImagePart:
    return ImagePart(img, image_hash(t.salt, img))


def msg(role: str, *parts: str | ImagePart) -> ChatMessage:
    return ChatMessage(role, tuple(TextPart(p) if isinstance(p, str) else p for p in parts))  # type: ignore[arg-type]


def run(
    runner: ModelRunner,
    t: Tenant,
    messages: Sequence[ChatMessage],
    *,
    session: str | None = "s1",
    max_tokens: int = 8,
    sampling: SamplingParams | None = None,
) -> Result:
    events: list[object] = []
    params = sampling or SamplingParams(max_tokens=max_tokens)
    runner.generate(GenerationRequest("req", t, session, tuple(messages), params), events.append, lambda: False)
    errors = [e for e in events if isinstance(e, EngineError)]
    assert not errors, errors
    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    tokens = [e.token_id for e in events if isinstance(e, TokenEvent)]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    return Result(tokens, text, finish.usage, finish.finish_reason, runner.last_trace)


def session_messages(
    t: Tenant, session: Session, turn_index: int, replies: Sequence[str]
) -> list[ChatMessage]:
    """Turn ``turn_index`` of a fixture session, with ``replies`` as the assistant turns."""
    out: list[ChatMessage] = []
    system = session.system_text()
    if system is not None:
        out.append(msg("system", system))
    for i, turn in enumerate(session.turns[: turn_index + 1]):
        parts: list[str | ImagePart] = []
        for p in turn.user:
            if isinstance(p, FixtureText):
                parts.append(p.text)
            else:
                assert isinstance(p, FixtureImage)
                parts.append(image_part(t, p.load()))
        out.append(msg("user", *parts))
        if i < turn_index:
            out.append(msg("assistant", replies[i]))
    return out


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param
