"""Session and tenant erasure on the engine: after erasing session S no file, index row or RAM
block holds S's private blocks (nor its image features), session T's shared system prompt still
hits, and S's conversation hits exactly what the other sessions still own."""

from __future__ import annotations

from pathlib import Path

from kv_cache.tiers.ssd_index import RecordKind
from tests.engine.conftest import image_part, msg, picture, run
from tests.lifecycle.engine import SYSTEM, block_owners, file_names, make_runner, raw_bytes, spill_resident, tenant


def t_turn(t):
    return [msg("system", SYSTEM), msg("user", "Where is my parcel number 4217? It was due on Monday.")]


def s_turn(t, reply: str | None = None):
    first = [msg("system", SYSTEM), msg("user", image_part(t, picture(5)), "What does this shipping label say?")]
    if reply is None:
        return first
    return [*first, msg("assistant", reply), msg("user", "And how heavy is the parcel?")]


def test_erasing_a_session_leaves_nothing_of_it_on_disk_or_in_ram(tmp_path: Path) -> None:
    a, b = tenant("alice"), tenant("bob")
    runner = make_runner(tmp_path)
    run(runner, a, t_turn(a), session="T")
    reply = run(runner, a, s_turn(a), session="S").text
    s_second = run(runner, a, s_turn(a, reply), session="S")
    assert s_second.usage.cached_tokens > 0
    run(runner, b, s_turn(b), session="S")  # session S of another tenant: not erased
    spill_resident(runner)  # every block also on disk (features are written through)
    owners = block_owners(runner, a.namespace)
    private = sorted(h for h, who in owners.items() if who == {"S"})
    shared = sorted(h for h, who in owners.items() if {"S", "T"} <= who)
    assert private and shared
    image = image_part(a, picture(5)).image_hash
    bob_blocks = sorted(blk.block_hash for blk in runner.prefix_cache.pool if blk.namespace == b.namespace)
    resident_private = [h for h in private if h in runner.prefix_cache.pool]
    file_size = {row.key: row.size for row in runner.ssd.rows(RecordKind.KV)}

    report = runner.erase_session(a, "S")

    assert report.kv_ram.count == len(resident_private) == len(private)
    assert report.kv_ssd.count == len(private)
    assert report.kv_ssd.nbytes == sum(file_size[bytes(h)] for h in private)
    assert (report.vision_ram.count, report.vision_ssd.count) == (1, 1)
    assert report.kept_shared_blocks == len(shared)
    assert report.replies == 2
    names = "\n".join(file_names(tmp_path))
    raw = raw_bytes(tmp_path)
    for h in [*private, image]:
        assert h.hex() not in names
        assert bytes(h) not in raw and h.hex().encode() not in raw
        assert h not in runner.prefix_cache.pool
    keys = {row.key for row in runner.ssd.rows(RecordKind.KV) + runner.ssd.rows(RecordKind.VISION)}
    assert not keys & {bytes(h) for h in [*private, image]}
    assert all("S" not in who for who in block_owners(runner, a.namespace).values())
    assert sorted(blk.block_hash for blk in runner.prefix_cache.pool if blk.namespace == b.namespace) == bob_blocks

    # The same conversation from S hits exactly what T's requests left: a runner that only ever
    # saw T's request is the reference.
    reference = make_runner(None)
    run(reference, a, t_turn(a), session="T")
    expected = run(reference, a, s_turn(a, reply), session="S")
    after = run(runner, a, s_turn(a, reply), session="S")
    assert 0 < after.usage.cached_tokens == expected.usage.cached_tokens < s_second.usage.cached_tokens
    assert (after.trace.encoder_runs, after.trace.vision_hits) == (1, 0)
    assert after.tokens == expected.tokens
    # T's shared system prompt (and its own history) still hits.
    assert run(runner, a, t_turn(a), session="T").usage.cached_tokens >= len(shared) * 16
    runner.close()


def test_erasing_a_tenant_removes_all_its_state_and_only_its_state(tmp_path: Path) -> None:
    a, b = tenant("alice"), tenant("bob")
    runner = make_runner(tmp_path)
    for t in (a, b):
        reply = run(runner, t, s_turn(t), session="S").text
        run(runner, t, s_turn(t, reply), session="S")
        run(runner, t, t_turn(t), session=None)  # no session: erased only with the tenant
    spill_resident(runner)
    a_blocks = sorted(block_owners(runner, a.namespace))
    b_before = sorted(block_owners(runner, b.namespace))

    report = runner.erase_tenant(a)

    assert report.kv_ram.count == report.kv_ssd.count == len(a_blocks)
    assert (report.vision_ram.count, report.vision_ssd.count, report.replies) == (1, 1, 3)
    assert block_owners(runner, a.namespace) == {}
    assert sorted(block_owners(runner, b.namespace)) == b_before
    assert not (runner.ssd.layout.tree(RecordKind.KV) / a.namespace).exists()
    raw = raw_bytes(tmp_path)
    assert not any(bytes(h) in raw for h in a_blocks)
    assert run(runner, a, s_turn(a), session="S").usage.cached_tokens == 0
    assert run(runner, b, s_turn(b), session="S").usage.cached_tokens > 0
    runner.close()
