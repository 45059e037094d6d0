"""Malformed requests against a live server: each gets its status and OpenAI's error envelope,
and a good request right after it still succeeds."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.conftest import LiveServer, make_config, running_server
from tests.server.helpers import assert_envelope, data_url, image_message, png_bytes, png_data_url

MAX_BODY = 256 * 1024
MAX_IMAGE_BYTES = 64 * 1024
MODEL = "served-tiny"  # --model-name: requests must name it (or the engine's own id)


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = make_config(tiny_model_path, tmp_path_factory.mktemp("state"), model_name=MODEL,
                         max_images=2, max_image_pixels=64 * 64, max_image_bytes=MAX_IMAGE_BYTES,
                         max_body_bytes=MAX_BODY)
    with running_server(config) as live:
        yield live


def _user(text: str = "hi") -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _user(), "max_tokens": 1, **fields}


def _image_parts(*urls: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"}]
             + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    code: str | None = None
    param: str | None = None
    json: Any = None
    content: bytes | None = None
    method: str = "POST"
    path: str = "/v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)


_LONG_PROMPT = " ".join(f"w{i}" for i in range(2500))  # ~12k tokens > 8192, the tiny context

CASES = [
    Case("malformed JSON", 400, "invalid_json", content=b'{"model": "x", "messages": ['),
    Case("empty body", 400, "invalid_json", content=b""),
    Case("not UTF-8", 400, "invalid_json", content=b'{"model": "\xff\xfe"}'),
    Case("top level is an array", 422, "invalid_type", json=[1, 2]),
    Case("messages is a string", 422, "invalid_type", "messages", json=_body(messages="hello")),
    Case("max_tokens is a string", 422, "invalid_type", "max_tokens", json=_body(max_tokens="abc")),
    Case("max_tokens is zero", 422, "invalid_type", "max_tokens", json=_body(max_tokens=0)),
    Case("temperature out of range", 422, "invalid_type", "temperature", json=_body(temperature=5)),
    Case("temperature is a string", 422, "invalid_type", "temperature", json=_body(temperature="hot")),
    Case("stream is a string", 422, "invalid_type", "stream", json=_body(stream="yes")),
    Case("stop is a number", 422, "invalid_type", "stop", json=_body(stop=5)),
    Case("content is a number", 422, "invalid_type", "messages[0].content",
         json=_body(messages=[{"role": "user", "content": 42}])),
    Case("message without role", 422, "invalid_type", "messages[0].role",
         json=_body(messages=[{"content": "hi"}])),
    Case("missing messages", 422, "invalid_type", "messages", json={"model": MODEL}),
    Case("missing model", 422, "invalid_type", "model", json={"messages": _user()}),
    Case("empty messages", 400, None, "messages", json=_body(messages=[])),
    Case("unknown role", 400, "invalid_role", "messages[0].role",
         json=_body(messages=[{"role": "wizard", "content": "hi"}])),
    Case("tool role", 400, "invalid_role", "messages[1].role",
         json=_body(messages=[*_user(), {"role": "tool", "content": "42"}])),
    Case("no user message", 400, None, "messages",
         json=_body(messages=[{"role": "system", "content": "be nice"}])),
    Case("empty content list", 400, None, "messages[0].content",
         json=_body(messages=[{"role": "user", "content": []}])),
    Case("user message without content", 400, None, "messages[0].content",
         json=_body(messages=[{"role": "user"}])),
    Case("unknown part type", 400, None, "messages[0].content[0].type",
         json=_body(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])),
    Case("text part without text", 400, None, "messages[0].content[0].text",
         json=_body(messages=[{"role": "user", "content": [{"type": "text"}]}])),
    Case("image part without image_url", 400, None, "messages[0].content[1].image_url",
         json=_body(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "image_url"}]}])),
    Case("bad base64", 400, "invalid_base64", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts("data:image/png;base64,@@not*base64@@"))),
    Case("not an image", 400, "invalid_image", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts(data_url(b"this is plain text, not a picture")))),
    Case("data URL of a non-image type", 400, "invalid_image_url", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts(data_url(png_bytes(), "text/plain")))),
    Case("image over the pixel limit", 400, "image_too_large", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts(png_data_url((65, 64))))),
    Case("image bytes over the limit", 413, "image_too_large", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts(data_url(os.urandom(MAX_IMAGE_BYTES + 1))))),
    Case("too many images", 400, "too_many_images", "messages",
         json=_body(messages=_image_parts(*[png_data_url((8, 8))] * 3))),
    Case("http image URL disabled", 400, "http_images_disabled", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts("http://127.0.0.1:9/cat.png"))),
    Case("file URL", 400, "invalid_image_url", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts("file:///etc/passwd"))),
    Case("local path", 400, "invalid_image_url", "messages[0].content[1].image_url",
         json=_body(messages=_image_parts("/etc/passwd"))),
    Case("image in a system message", 400, None, "messages[0].content[0]",
         json=_body(messages=[{"role": "system", "content": [
             {"type": "image_url", "image_url": {"url": png_data_url((8, 8))}}]}, *_user()])),
    Case("n above 1", 400, None, "n", json=_body(n=2)),
    Case("max_tokens above the context", 400, None, "max_tokens", json=_body(max_tokens=10**6)),
    Case("prompt longer than the context", 400, "context_length_exceeded", "messages",
         json=_body(messages=_user(_LONG_PROMPT))),
    Case("session id too long", 400, "invalid_session_id", "X-Session-Id", json=_body(),
         headers={"X-Session-Id": "s" * 300}),
    Case("unknown model", 404, "model_not_found", "model", json=_body(model="gpt-4o")),
    Case("unknown route", 404, "not_found", None, json=_body(), path="/v1/completions/nope"),
    Case("unknown model retrieve", 404, "model_not_found", "model", method="GET",
         path="/v1/models/gpt-4o"),
    Case("wrong method", 405, "method_not_allowed", None, method="GET"),
    Case("wrong method on models", 405, "method_not_allowed", None, method="DELETE",
         path="/v1/models"),
    Case("body too large", 413, "request_too_large", None,
         content=json.dumps(_body(messages=_user("x" * MAX_BODY))).encode()),
]


def test_at_least_25_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.name for c in CASES}) == len(CASES)


def _good_request(server: LiveServer) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, max_tokens=1,
        messages=[image_message("still there?", png_data_url((16, 16), (9, 99, 199)))])
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.model == MODEL


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_request_then_good_request(server: LiveServer, case: Case) -> None:
    with server.http() as http:
        kwargs: dict[str, Any] = {"headers": case.headers}
        if case.content is not None:
            kwargs["content"] = case.content
            kwargs["headers"] = {"Content-Type": "application/json", **case.headers}
        elif case.json is not None:
            kwargs["json"] = case.json
        response = http.request(case.method, case.path, **kwargs)
    assert response.status_code == case.status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = assert_envelope(response.json(), code=case.code)
    assert error["param"] == case.param, error
    expected_type = {404: "not_found_error"}.get(case.status, "invalid_request_error")
    assert error["type"] == expected_type, error
    _good_request(server)


def test_openai_client_raises_typed_errors(server: LiveServer) -> None:
    client = server.client()
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=_user(), max_tokens=1)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert bad.value.param == "messages"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=MODEL, messages=_user(), max_tokens="abc")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.chat.completions.create(model=MODEL, messages=_user(_LONG_PROMPT), max_tokens=1,
                                       stream=True)
    assert long_prompt.value.code == "context_length_exceeded"
    _good_request(server)


def test_engine_model_id_is_accepted_too(server: LiveServer, tiny_model_path: Path) -> None:
    """With --model-name the served name changes; the engine's own id (the model directory's
    name) stays accepted, and responses always echo the served name."""
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    reply = server.client().chat.completions.create(model=tiny_model_path.name, messages=_user(),
                                                    max_tokens=1)
    assert reply.model == MODEL
