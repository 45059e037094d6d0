"""``GET /metrics`` on a live server: it parses, and its counters agree with /v1/cache/stats."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer, make_config, running_server
from tests.server.helpers import image_message, png_data_url

MAX_TOKENS = 4
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = make_config(tiny_model_path, tmp_path_factory.mktemp("state"), block_size=16,
                         prefill_chunk=32)
    with running_server(config) as live:
        yield live


def scrape(server: LiveServer) -> Samples:
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def chat(server: LiveServer, messages: list[dict], *, stream: bool) -> tuple[str, int]:
    """One completion; returns (reply text, cached tokens)."""
    client = server.client()
    if not stream:
        reply = client.chat.completions.create(model=server.model, messages=messages,
                                               max_tokens=MAX_TOKENS, temperature=0)
        usage = reply.usage
        return reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens
    chunks = list(client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage.prompt_tokens_details.cached_tokens


def test_metrics_agree_with_cache_stats_after_a_conversation(server: LiveServer) -> None:
    messages = [{"role": "system", "content": "You answer questions about pictures, briefly."},
                image_message("What colour is the square in this picture?",
                              png_data_url((32, 32), (10, 200, 90)))]
    cached = []
    questions = ["And how large is it?", "Is it bright?"]
    for turn, stream in enumerate([True, False, True]):
        text, hits = chat(server, messages, stream=stream)
        cached.append(hits)
        if turn < len(questions):
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": questions[turn]}]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
    with server.http() as http:
        missing = http.post("/v1/chat/completions", json={"model": "no-such-model",
                                                          "messages": messages})
        assert missing.status_code == 404
        stats = http.get("/v1/cache/stats").json()["stats"]

    samples = scrape(server)
    # Prompt-token queries and hits: the RAM tier saw every prompt token, and the hits over
    # all tiers are the cached_tokens the clients were told.
    hits = sum(v for (name, _), v in samples.items()
               if name == "vlmcache_prefix_cache_hits_tokens_total")
    assert hits == stats["cached_tokens"] == sum(cached)
    queries = "vlmcache_prefix_cache_queries_tokens_total"
    assert value(samples, queries, tier="ram") == stats["prompt_tokens"]
    # The SSD tier (on by default) is asked for what RAM did not hold; nothing was evicted, so
    # it served nothing.
    assert stats["ssd"]["enabled"]
    ram_hits = value(samples, "vlmcache_prefix_cache_hits_tokens_total", tier="ram")
    assert value(samples, queries, tier="ssd") == stats["prompt_tokens"] - ram_hits
    ssd_hits = value(samples, "vlmcache_prefix_cache_hits_tokens_total", tier="ssd")
    assert ssd_hits == stats["cached_tokens_ssd"] == 0
    assert value(samples, "vlmcache_engine_requests_total") == stats["requests"] == 3
    assert value(samples, "vlmcache_generation_tokens_total") == stats["completion_tokens"]
    assert value(samples, "vlmcache_vision_cache_queries_total") == stats["vision_queries"]
    assert value(samples, "vlmcache_vision_cache_hits_total") == stats["vision_hits"]
    assert value(samples, "vlmcache_vision_encoder_runs_total") == stats["encoder_runs"] == 1
    # Block-level hits and miss reasons.
    assert value(samples, "vlmcache_prefix_cache_hit_blocks_total") == stats["hit_blocks"] > 0
    reasons = {dict(labels)["reason"]: v for (name, labels), v in samples.items()
               if name == "vlmcache_prefix_cache_miss_blocks_total"}
    assert reasons == stats["miss_reasons"]
    assert sum(reasons.values()) == stats["missed_blocks"] > 0
    # Tiers: resident bytes and evictions of the RAM tier.
    kv, vision = {"cache": "kv", "tier": "ram"}, {"cache": "vision", "tier": "ram"}
    assert value(samples, "vlmcache_cache_resident_bytes", **kv) == stats["kv"]["resident_bytes"] > 0
    assert value(samples, "vlmcache_cache_evictions_total", **kv) == stats["kv"]["evictions"]
    assert value(samples, "vlmcache_cache_entries", **vision) == stats["vision"]["entries"] == 1
    # HTTP side: requests by endpoint/status/stream, one TTFT per completion.
    assert value(samples, "vlmcache_requests_total", endpoint="chat_completions", status="200",
                 stream="true") == 2
    assert value(samples, "vlmcache_requests_total", endpoint="chat_completions", status="200",
                 stream="false") == 1
    assert value(samples, "vlmcache_requests_total", endpoint="chat_completions", status="404",
                 stream="false") == 1
    assert value(samples, "vlmcache_time_to_first_token_seconds_count") == 3
    assert value(samples, "vlmcache_e2e_request_latency_seconds_count") == 3
    finished = sum(v for (name, _), v in samples.items() if name == "vlmcache_completions_total")
    assert finished == 3
    # No label anywhere names a tenant.
    assert not any("tenant" in dict(labels) for _, labels in samples)


def test_metrics_need_an_admin_key_when_keys_are_configured(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[tenants.ops]\nadmin = true\nkeys = ["sk-ops-0123456789abcdef"]\n'
                    '[tenants.alice]\nkeys = ["sk-alice-0123456789abcdef"]\n')
    config = make_config(tiny_model_path, tmp_path / "state", keys_file=keys)
    with running_server(config) as live, live.http() as http:
        assert http.get("/metrics").status_code == 401
        alice = http.get("/metrics", headers={"Authorization": "Bearer sk-alice-0123456789abcdef"})
        assert alice.status_code == 403
        ops = http.get("/metrics", headers={"Authorization": "Bearer sk-ops-0123456789abcdef"})
        assert ops.status_code == 200
        families = {f.name for f in text_string_to_metric_families(ops.text)}
        assert {"vlmcache_prefix_cache_hits_tokens", "vlmcache_time_to_first_token_seconds",
                "vlmcache_prefix_cache_miss_blocks", "vlmcache_cache_resident_bytes"} <= families
