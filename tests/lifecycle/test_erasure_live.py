"""Erasure through the live HTTP API (real server, openai client for chat, httpx for DELETE):
a session's private blocks leave the disk and its conversation loses exactly its own reuse,
the shared system prompt keeps hitting; tenant erasure and the admin rules (403, 404)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lifecycle.engine import file_names, raw_bytes
from tests.server.conftest import LiveServer, make_config, running_server
from tests.server.helpers import assert_envelope, image_message, png_data_url

KEYS_TOML = """
[tenants.alice]
keys = ["sk-alice"]

[tenants.bob]
keys = ["sk-bob"]

[tenants.ops]
keys = ["sk-admin"]
admin = true
"""

SYSTEM = ("You are the careful assistant of a shipping company. Answer briefly, politely, and "
          "always mention the parcel number you were asked about.")


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("erasure")
    keys = root / "keys.toml"
    keys.write_text(KEYS_TOML)
    # A RAM budget of a few blocks: most blocks spill to the SSD tier, where the scan looks.
    config = make_config(tiny_model_path, root / "state", keys_file=keys, block_size=16,
                         prefill_chunk=32, ram_budget_bytes=6 * 8192, ssd_queue_size=4096)
    with running_server(config) as live:
        yield live


def ask(server: LiveServer, key: str, session: str, messages: list[dict]) -> tuple[str, int]:
    reply = server.client(api_key=key).chat.completions.create(
        model=server.model, messages=messages, max_tokens=4, temperature=0,
        extra_headers={"X-Session-Id": session})
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def t_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Where is my parcel number 4217? It was due on Monday."}]


def s_messages(reply: str | None = None) -> list[dict]:
    first = [{"role": "system", "content": SYSTEM},
             image_message("What does this shipping label say?", png_data_url((40, 40), (30, 160, 90)))]
    if reply is None:
        return first
    return [*first, {"role": "assistant", "content": reply},
            {"role": "user", "content": "And how heavy is the parcel?"}]


def index_rows(server: LiveServer) -> list[tuple[str, bytes, str, list[str]]]:
    """(kind, key, namespace, owners) of every SSD index row, read while the server runs."""
    import json

    out = []
    for db in sorted((server.config.cache_dir / "ssd").glob("*/index.sqlite3")):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            for kind, key, ns, owners in conn.execute("SELECT kind, key, namespace, owners FROM entries"):
                out.append((kind, bytes(key), ns, json.loads(owners)))
    return out


def wait_for_disk(server: LiveServer, admin_key: str = "sk-admin") -> None:
    """Wait until the SSD writer has committed every queued record (it writes in the background)."""
    import time

    deadline = time.monotonic() + 10.0
    with server.http() as http:
        while True:
            stats = http.get("/v1/cache/stats", headers={"Authorization": f"Bearer {admin_key}"})
            assert stats.status_code == 200, stats.text
            if stats.json()["stats"]["ssd"]["queued"] == 0:
                return
            assert time.monotonic() < deadline, "the SSD writer did not drain its queue"
            time.sleep(0.05)


def namespace_of(server: LiveServer, tenant_id: str) -> str:
    from tenancy.secret import read_secret
    from tenancy.tenants import make_tenant

    return make_tenant(read_secret(server.config.cache_dir), tenant_id).namespace


def test_deleting_a_session_erases_its_private_state_and_keeps_the_shared_prompt(server: LiveServer) -> None:
    alice = namespace_of(server, "alice")
    ask(server, "sk-alice", "T", t_messages())
    _, t_cached = ask(server, "sk-alice", "T", t_messages())
    reply, _ = ask(server, "sk-alice", "S", s_messages())
    _, s_cached = ask(server, "sk-alice", "S", s_messages(reply))
    ask(server, "sk-bob", "S", s_messages())  # bob's session S is another session
    assert s_cached > 0 and t_cached > 0
    wait_for_disk(server)
    rows = index_rows(server)
    private = {key for kind, key, ns, owners in rows if ns == alice and owners == ["S"]}
    private_blocks = {key for kind, key, ns, owners in rows if kind == "kv" and key in private}
    assert private_blocks and len(private) == len(private_blocks) + 1  # + the image's features

    with server.http() as http:
        response = http.delete("/v1/cache/sessions/S", headers={"Authorization": "Bearer sk-alice"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "cache.erasure" and (body["tenant"], body["session"]) == ("alice", "S")
    tiers = body["tiers"]
    assert tiers["kv_ssd"]["count"] >= len(private_blocks)
    assert tiers["kv_ssd"]["bytes"] > 0
    assert (tiers["vision_ram"]["count"], tiers["vision_ssd"]["count"]) == (1, 1)
    assert body["kept_shared_blocks"] > 0 and body["replies"] == 2

    rows = index_rows(server)
    assert not {key for _, key, _, _ in rows} & private
    assert all("S" not in owners for _, _, ns, owners in rows if ns == alice)
    assert any("S" in owners for _, _, ns, owners in rows if ns == namespace_of(server, "bob"))
    names = "\n".join(file_names(server.config.cache_dir))
    raw = raw_bytes(server.config.cache_dir)
    for key in private:
        assert key.hex() not in names and key not in raw

    _, s_after = ask(server, "sk-alice", "S", s_messages(reply))
    assert 0 < s_after < s_cached  # only what T's requests left (the system prompt)
    assert ask(server, "sk-alice", "T", t_messages())[1] >= t_cached


def test_deleting_a_tenant_and_the_admin_rules(server: LiveServer) -> None:
    ask(server, "sk-bob", "B1", t_messages())
    assert ask(server, "sk-bob", "B1", t_messages())[1] > 0
    alice_before = ask(server, "sk-alice", "T", t_messages())[1]
    with server.http() as http:
        forbidden = http.delete("/v1/cache", headers={"Authorization": "Bearer sk-alice"},
                                params={"tenant": "bob"})
        assert forbidden.status_code == 403
        assert assert_envelope(forbidden.json(), code="insufficient_permissions")["type"] == "permission_error"
        missing = http.delete("/v1/cache", headers={"Authorization": "Bearer sk-admin"},
                              params={"tenant": "nobody"})
        assert missing.status_code == 404
        assert_envelope(missing.json(), code="tenant_not_found", param="tenant")
        too_long = http.delete("/v1/cache/sessions/" + "x" * 300, headers={"Authorization": "Bearer sk-bob"})
        assert too_long.status_code == 400
        assert_envelope(too_long.json(), code="invalid_session_id", param="session_id")
        assert http.delete("/v1/cache").status_code == 401
        erased = http.delete("/v1/cache", headers={"Authorization": "Bearer sk-admin"},
                             params={"tenant": "bob"})
    assert erased.status_code == 200, erased.text
    body = erased.json()
    assert (body["tenant"], body["session"]) == ("bob", None)
    assert body["tiers"]["kv_ram"]["count"] + body["tiers"]["kv_ssd"]["count"] > 0
    bob = namespace_of(server, "bob")
    assert not [row for row in index_rows(server) if row[2] == bob]
    assert ask(server, "sk-bob", "B1", t_messages())[1] == 0
    assert ask(server, "sk-alice", "T", t_messages())[1] == alice_before
    with server.http() as http:
        own = http.delete("/v1/cache", headers={"Authorization": "Bearer sk-alice"}, params={"tenant": "alice"})
    assert own.status_code == 200 and own.json()["tenant"] == "alice"
