"""JSON bodies -> wire Structs: 400 for bad JSON, 422 naming the field for wrong types."""

from __future__ import annotations

import pytest

from server.api.body import decode_body
from server.api.errors import ApiError
from server.api.schemas import ChatCompletionRequest


def _error(body: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        decode_body(body, ChatCompletionRequest)
    return info.value


def test_valid_body_with_unknown_fields() -> None:
    wire = decode_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                       b'"frequency_penalty": 0.5, "logit_bias": {"1": 2}, "stop": null}',
                       ChatCompletionRequest)
    assert wire.model == "m"
    assert wire.messages[0].content == "hi"
    assert wire.stop is None


@pytest.mark.parametrize(("body", "status", "param"), [
    (b"", 400, None),
    (b"  \n", 400, None),
    (b"{", 400, None),
    (b'{"model": "m", "messages": []} trailing', 400, None),
    (b"[]", 422, None),
    (b'{"messages": []}', 422, "model"),
    (b'{"model": "m", "messages": [{"content": "x"}]}', 422, "messages[0].role"),
    (b'{"model": "m", "messages": [], "max_tokens": true}', 422, "max_tokens"),
    (b'{"model": "m", "messages": [], "stream_options": {"include_usage": "y"}}', 422,
     "stream_options.include_usage"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": 1}]}]}', 422,
     "messages[0].content[0].type"),
])
def test_errors(body: bytes, status: int, param: str | None) -> None:
    error = _error(body)
    assert (error.status, error.param) == (status, param)
    assert error.code == ("invalid_json" if status == 400 else "invalid_type")
