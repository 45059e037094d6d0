"""Miss reasons through the real engine (tiny qwen2_vl): every reason produced on purpose and
seen in ``cache_stats`` and the metrics snapshot; the SSD tier's share of the hits."""

from __future__ import annotations

from pathlib import Path

from kv_cache.hashing import CACHE_FORMAT_VERSION, chain_hashes, root_hash
from server.engine.model import LoadedModel
from server.engine.runner import ModelRunner
from server.engine.settings import EngineSettings
from server.engine.types import ChatMessage
from tenancy.tenants import Tenant
from tests.engine.conftest import image_part, loaded, make_runner, msg, picture, run, tenant

SYSTEM = ("You are a careful assistant who describes pictures in plain words, one short "
          "sentence at a time, and never guesses.")
REASONS = ("cold", "evicted", "expired", "diverged")


def ask(t: Tenant, image_seed: int, question: str = "What is in the picture?") -> list[ChatMessage]:
    return [msg("system", SYSTEM), msg("user", image_part(t, picture(image_seed)), question)]


def reasons(runner: ModelRunner, t: Tenant | None) -> dict[str, int]:
    return dict(runner.cache_stats(t)["miss_reasons"])


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_each_reason_is_counted() -> None:
    runner = make_runner("qwen2_vl")
    alice, bob = tenant("alice"), tenant("bob")
    ns = alice

    before = reasons(runner, ns)
    first = run(runner, alice, ask(alice, 1))
    blocks = (first.usage.prompt_tokens - 1) // 16
    assert delta(before, reasons(runner, ns)) == {"cold": blocks}

    # Same text, another picture at the same place: the text blocks hit, the image block differs.
    before = reasons(runner, ns)
    other = run(runner, alice, ask(alice, 2))
    hit_blocks = other.usage.cached_tokens // 16
    assert 0 < hit_blocks < blocks
    assert delta(before, reasons(runner, ns)) == {"diverged": 1, "cold": blocks - hit_blocks - 1}

    # Bob sends alice's exact first request: isolated in the global view, cold in bob's.
    everyone = reasons(runner, None)
    run(runner, bob, ask(bob, 1))
    assert delta(everyone, reasons(runner, None)) == {"isolated": blocks}
    assert reasons(runner, bob) == {"cold": blocks, "evicted": 0, "expired": 0, "diverged": 0}
    assert "isolated" not in reasons(runner, bob)

    # Expired: drop alice's first chain as the TTL sweeper would, then ask again.
    prompt = runner.prompt_builder.build(ask(alice, 1), alice.namespace)
    root = root_hash(CACHE_FORMAT_VERSION, runner.fingerprint, alice.salt)
    for digest in chain_hashes(root, prompt.token_ids[: blocks * 16], prompt.spans, 16):
        block = runner.prefix_cache.pool.get(digest)
        if block is not None:
            runner.prefix_cache.discard(block)
        runner.misses.record_expired(digest)
    before = reasons(runner, ns)
    again = run(runner, alice, ask(alice, 1))
    assert again.usage.cached_tokens < 16
    assert delta(before, reasons(runner, ns)) == {"expired": blocks}

    # Evicted: RAM makes room by evicting everything (this runner has no SSD tier to keep it).
    budget = runner.ram.budget_bytes
    assert runner.ram.set_budget(0)
    runner.ram.set_budget(budget)
    before = reasons(runner, ns)
    run(runner, alice, ask(alice, 1))
    assert delta(before, reasons(runner, ns)) == {"evicted": blocks}

    snap = runner.metrics_snapshot()
    assert dict(snap.miss_blocks) == reasons(runner, None)
    assert snap.miss_blocks["isolated"] == blocks
    assert all(snap.miss_blocks[r] > 0 for r in REASONS)
    assert snap.hit_blocks == runner.cache_stats(None)["hit_blocks"]


def test_tokens_served_from_ssd_are_counted_by_tier(tmp_path: Path) -> None:
    model: LoadedModel = loaded("qwen2_vl")
    settings = EngineSettings(model_path=Path("unused"), cache_dir=tmp_path, block_size=16,
                              prefill_chunk=32, ram_budget_bytes=256 << 20)
    runner = ModelRunner(model, settings)
    try:
        alice = tenant("alice")
        first = run(runner, alice, ask(alice, 1))
        runner.ssd.flush()
        # Push every block out of RAM (they go to SSD), then ask again: the hit comes from SSD.
        runner.ram.set_budget(0)
        runner.ssd.flush()
        runner.ram.set_budget(256 << 20)
        second = run(runner, alice, ask(alice, 1))
        assert second.usage.cached_tokens > 0
        stats = runner.cache_stats(None)
        assert stats["cached_tokens_ssd"] == second.usage.cached_tokens
        snap = runner.metrics_snapshot()
        assert dict(snap.hit_tokens_by_tier) == {"ram": 0, "ssd": second.usage.cached_tokens}
        assert first.usage.cached_tokens == 0
        ssd = [t for t in snap.tiers if t.tier == "ssd"]
        assert len(ssd) == 1 and ssd[0].promotions > 0 and ssd[0].spills > 0
    finally:
        runner.close()
