"""API-key tenants against a live server with a keys file: 401/403, isolation of cached state,
and a multi-turn conversation that reuses more of its prefix every turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import LiveServer, make_config, running_server
from tests.server.helpers import assert_envelope, image_message, png_data_url

KEYS_TOML = """
[tenants.alice]
keys = ["sk-alice"]

[tenants.bob]
keys = ["sk-bob"]

[tenants.carol]
keys = ["sk-carol"]

[tenants.ops]
keys = ["sk-admin"]
admin = true
"""


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("tenants")
    keys = root / "keys.toml"
    keys.write_text(KEYS_TOML)
    with running_server(make_config(tiny_model_path, root / "state", keys_file=keys)) as live:
        yield live


def _ask(server: LiveServer, key: str, messages: list[dict]) -> openai.types.chat.ChatCompletion:
    return server.client(api_key=key).chat.completions.create(
        model=server.model, messages=messages, max_tokens=3, temperature=0)


def _good_request(server: LiveServer) -> None:
    reply = _ask(server, "sk-admin", [{"role": "user", "content": "ping"}])
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("headers", "path"), [
    ({}, "/v1/chat/completions"),
    ({"Authorization": "Bearer sk-wrong"}, "/v1/chat/completions"),
    ({"Authorization": "Basic c2stYWxpY2U="}, "/v1/chat/completions"),
    ({"Authorization": "Bearer"}, "/v1/chat/completions"),
    ({}, "/v1/models"),
    ({}, "/v1/cache/stats"),
], ids=["no key", "wrong key", "basic auth", "empty bearer", "models without key",
        "stats without key"])
def test_unauthenticated_is_401(server: LiveServer, headers: dict[str, str], path: str) -> None:
    with server.http() as http:
        if path == "/v1/chat/completions":
            response = http.post(path, headers=headers, json={
                "model": server.model, "messages": [{"role": "user", "content": "hi"}]})
        else:
            response = http.get(path, headers=headers)
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    error = assert_envelope(response.json(), code="invalid_api_key")
    assert error["type"] == "authentication_error"
    assert "sk-wrong" not in error["message"]
    _good_request(server)


def test_openai_client_with_wrong_key_raises_authentication_error(server: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError):
        _ask(server, "sk-nobody", [{"role": "user", "content": "hi"}])
    _good_request(server)


def test_health_needs_no_key(server: LiveServer) -> None:
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_cache_stats_scoping(server: LiveServer) -> None:
    alice = {"Authorization": "Bearer sk-alice"}
    admin = {"Authorization": "Bearer sk-admin"}
    with server.http() as http:
        own = http.get("/v1/cache/stats", headers=alice)
        assert own.status_code == 200 and own.json()["tenant"] == "alice"
        assert http.get("/v1/cache/stats", headers=alice, params={"tenant": "alice"}).json()["tenant"] == "alice"
        other = http.get("/v1/cache/stats", headers=alice, params={"tenant": "bob"})
        assert other.status_code == 403
        assert assert_envelope(other.json(), code="insufficient_permissions")["type"] == "permission_error"
        everyone = http.get("/v1/cache/stats", headers=admin)
        assert everyone.status_code == 200 and everyone.json()["tenant"] is None
        bob = http.get("/v1/cache/stats", headers=admin, params={"tenant": "bob"})
        assert bob.status_code == 200 and bob.json()["tenant"] == "bob"
        missing = http.get("/v1/cache/stats", headers=admin, params={"tenant": "nobody"})
        assert missing.status_code == 404
        assert_envelope(missing.json(), code="tenant_not_found", param="tenant")
    _good_request(server)


def test_two_tenants_do_not_share_cached_tokens(server: LiveServer) -> None:
    """Needs the engine's tenant-salted prefix cache."""
    turn_one = [{"role": "system", "content": "You are a careful observer of pictures."},
                image_message("What colour is this square?", png_data_url((36, 36), (250, 200, 0)))]
    first_a = _ask(server, "sk-alice", turn_one)
    assert first_a.usage.prompt_tokens_details.cached_tokens == 0
    again_a = _ask(server, "sk-alice", turn_one)
    assert again_a.usage.prompt_tokens_details.cached_tokens > 0
    turn_two = turn_one + [{"role": "assistant", "content": first_a.choices[0].message.content},
                           {"role": "user", "content": "And its size?"}]
    assert _ask(server, "sk-alice", turn_two).usage.prompt_tokens_details.cached_tokens > 0

    first_b = _ask(server, "sk-bob", turn_one)
    assert first_b.usage.prompt_tokens_details.cached_tokens == 0
    assert first_b.usage.prompt_tokens == first_a.usage.prompt_tokens
    assert _ask(server, "sk-bob", turn_one).usage.prompt_tokens_details.cached_tokens > 0


def test_five_turn_image_conversation_cached_tokens_grow(server: LiveServer) -> None:
    """Needs the engine's prefix cache: turn 1 is cold (fresh tenant), every later turn reuses
    the whole previous conversation, including the assistant's replies."""
    client = server.client(api_key="sk-carol")
    messages = [image_message("Look at this picture carefully.", png_data_url((40, 40), (10, 10, 250)))]
    cached: list[int] = []
    for turn in range(5):
        reply = client.chat.completions.create(model=server.model, messages=messages,
                                               max_tokens=4, temperature=0,
                                               extra_headers={"X-Session-Id": "five-turns"})
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"Tell me more, part {turn + 2}."}]
    assert cached[0] == 0
    assert all(later > earlier for earlier, later in zip(cached, cached[1:])), cached
