"""The engine with its SSD tier, on the tiny fixtures of the three cache families: evicted
blocks come back from disk, damaged files are misses, a new runner on the same directory picks
up where the last one stopped; the output always equals a cold run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures.conversation import load_conversation
from kv_cache.hashing import CACHE_FORMAT_VERSION, chain_hashes, root_hash
from kv_cache.tiers.ssd_index import RecordKind
from server.engine.prompt import ReplyLedger
from server.engine.runner import ModelRunner
from tests.engine.conftest import BLOCK, image_part, msg, picture, run, session_messages, tenant
from tests.ssd.factories import make_runner

SESSION = load_conversation("one_image_10_turns").sessions[0]

# Enough RAM for one conversation turn's chain, not for it and the other traffic.
RAM_BUDGET = {"qwen2_vl": 12 * 8192, "gemma3": 12 * 8192, "qwen3_5": 300_000}


def serve_turns(runner: ModelRunner, t, turns: int, replies: list[str] | None = None) -> list[str]:
    replies = [] if replies is None else replies
    for turn in range(len(replies), turns):
        result = run(runner, t, session_messages(t, SESSION, turn, replies), max_tokens=10)
        replies.append(result.text)
    return replies


def other_traffic(runner: ModelRunner, t, count: int = 4) -> None:
    for i in range(count):
        prompt = "Describe this picture in careful detail, every shape and colour. " * 2
        run(runner, t, [msg("user", image_part(t, picture(60 + i)), prompt)], session=f"other{i}")


def test_tiny_ram_spills_every_evicted_block_and_serves_it_back(family: str, tmp_path: Path) -> None:
    t = tenant()
    ledger = ReplyLedger()
    runner = make_runner(family, tmp_path, ram_budget_bytes=RAM_BUDGET[family], ledger=ledger)
    evicted = []
    runner.prefix_cache.watch_evictions(evicted.append)
    replies = serve_turns(runner, t, 2)
    other_traffic(runner, t)
    runner.ssd.flush()
    assert len(evicted) > 10
    on_disk = runner.ssd.find_blocks([b.block_hash for b in evicted])
    assert set(on_disk) == {b.block_hash for b in evicted}
    stats = runner.ssd.stats()
    assert (stats.drops, stats.write_errors, stats.unfiled) == (0, 0, 0)

    # The same history on unbounded RAM: the reuse the SSD tier must give back.
    reference = make_runner(family, None, ledger=ledger)
    serve_turns(reference, t, 2, [])
    other_traffic(reference, t)
    messages = session_messages(t, SESSION, 2, replies)
    warm = run(runner, t, messages, max_tokens=10)
    unbounded = run(reference, t, messages, max_tokens=10)
    cold = run(make_runner(family, None, ledger=ledger), t, messages, max_tokens=10)
    assert runner.tiered.stats.promotions > 0
    assert warm.usage.cached_tokens == unbounded.usage.cached_tokens > 0
    assert warm.tokens == unbounded.tokens == cold.tokens
    assert runner.ram.used_bytes <= runner.ram.budget_bytes
    runner.close()


def _first_turns_on_disk(family: str, cache_dir: Path, t, ledger: ReplyLedger, turns: int) -> list[str]:
    runner = make_runner(family, cache_dir, ledger=ledger)
    replies = serve_turns(runner, t, turns)
    runner.close()  # writes every resident block
    return replies


def _damage(path: Path, how: str, donor: Path) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[-9] ^= 0x40
    elif how == "truncate":
        del data[len(data) // 2 :]
    else:  # "header": another block's (valid) header in front of this block's tensors
        header_len = int.from_bytes(data[:8], "little")
        other = donor.read_bytes()
        other_len = int.from_bytes(other[:8], "little")
        data = bytearray(other[: 8 + other_len]) + data[8 + header_len :]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "header"])
def test_damaged_file_is_quarantined_and_served_as_a_miss(family: str, how: str, tmp_path: Path) -> None:
    t = tenant()
    ledger = ReplyLedger()
    replies = _first_turns_on_disk(family, tmp_path, t, ledger, 2)
    runner = make_runner(family, tmp_path, ledger=ledger)
    messages = session_messages(t, SESSION, 2, replies)
    prompt = runner.prompt_builder.build(messages, t.namespace)
    root = root_hash(CACHE_FORMAT_VERSION, runner.fingerprint, t.salt)
    hashes = chain_hashes(root, prompt.token_ids, prompt.spans, BLOCK)
    path = runner.ssd.layout.path(RecordKind.KV, t.namespace, hashes[3])
    _damage(path, how, runner.ssd.layout.path(RecordKind.KV, t.namespace, hashes[4]))

    warm = run(runner, t, messages, max_tokens=10)
    cold = run(make_runner(family, None, ledger=ledger), t, messages, max_tokens=10)
    assert warm.tokens == cold.tokens
    if family == "qwen3_5":
        assert 2 * BLOCK <= warm.usage.cached_tokens <= 3 * BLOCK  # a checkpoint before block 3
    else:
        assert warm.usage.cached_tokens == 3 * BLOCK  # blocks 0..2; block 3 is a miss
    stats = runner.ssd.stats()
    assert (stats.quarantined, runner.tiered.stats.promotion_failures) == (1, 1)
    assert not path.exists()
    assert [p.name.split("-")[:2] for p in (tmp_path / "quarantine").iterdir()] == [["kv", hashes[3].hex()]]
    runner.close()


def test_new_runner_on_the_same_directory_continues_the_conversation(family: str, tmp_path: Path) -> None:
    t = tenant()
    replies = _first_turns_on_disk(family, tmp_path, t, ReplyLedger(), 4)
    # A restarted server: empty RAM, and its reply ledger knows nothing of the old replies.
    runner = make_runner(family, tmp_path, ledger=ReplyLedger())
    assert len(runner.prefix_cache) == 0 and len(runner.features) == 0
    messages = session_messages(t, SESSION, 4, replies)
    warm = run(runner, t, messages, max_tokens=10)
    cold = run(make_runner(family, None, ledger=ReplyLedger()), t, messages, max_tokens=10)
    assert warm.tokens == cold.tokens
    assert warm.usage.cached_tokens > 0
    assert runner.tiered.stats.promotions > 0
    assert warm.trace.encoder_runs == 0  # the turn-1 image: inside the prefix, or features from SSD
    runner.close()


def test_vision_features_survive_a_restart(family: str, tmp_path: Path) -> None:
    t = tenant()
    img = image_part(t, picture(7))
    first = make_runner(family, tmp_path)
    assert run(first, t, [msg("user", img, "What is in this image?")]).trace.encoder_runs == 1
    first.close()
    runner = make_runner(family, tmp_path)
    moved = [msg("user", "Here is a picture I took yesterday at the market, look closely:", img)]
    warm = run(runner, t, moved)
    assert warm.trace.encoder_runs == 0
    assert runner.feature_ssd.stats.hits == 1
    cold = run(make_runner(family, None), t, moved)
    assert warm.tokens == cold.tokens
    runner.close()


def test_disk_layout_hides_tenants_and_keeps_them_apart(tmp_path: Path) -> None:
    alice, bob = tenant("alice"), tenant("bob")
    img = picture(9)
    question = "Describe the image in detail."
    first = make_runner("qwen2_vl", tmp_path)
    run(first, alice, [msg("user", image_part(alice, img), question)])
    first.close()
    files = [p for p in tmp_path.rglob("*.safetensors")]
    assert files and all("alice" not in str(p) for p in files)
    namespaces = {p.relative_to(tmp_path).parts[2] for p in files}
    assert namespaces == {alice.namespace}
    runner = make_runner("qwen2_vl", tmp_path)
    other = run(runner, bob, [msg("user", image_part(bob, img), question)])
    assert (other.usage.cached_tokens, other.trace.encoder_runs) == (0, 1)
    again = run(runner, alice, [msg("user", image_part(alice, img), question)])
    assert again.usage.cached_tokens > 0 and again.trace.encoder_runs == 0
    runner.close()
