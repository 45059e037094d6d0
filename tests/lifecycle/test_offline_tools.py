"""``vlmcache cache stats|verify|gc|erase`` on a cache directory written by a real engine:
per-tenant stats, refusal while a server holds the tier lock, checksum verification and
quarantine, retention/quota/budget collection, tenant and session erasure."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kv_cache.tiers.ssd_index import RecordKind, SsdIndex
from kv_cache.tiers.ssd_layout import SsdLayout
from server.cli import main
from tests.engine.conftest import SECRET, image_part, msg, picture, run
from tests.lifecycle.engine import SYSTEM, make_runner
from tests.lifecycle.factories import Clock
from tenancy.secret import SECRET_FILE_NAME
from tenancy.tenants import make_tenant

KEYS = """
[tenants.alice]
keys = ["sk-alice"]
retention_seconds = 3600

[tenants.bob]
keys = ["sk-bob"]
ssd_quota_bytes = 1
"""


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory with alice (sessions S and T sharing a system prompt, an image) and bob,
    written by an engine whose clock says 1970 (so alice's retention has long passed)."""
    root = tmp_path_factory.mktemp("offline") / "state"
    root.mkdir(mode=0o700)
    (root / SECRET_FILE_NAME).write_bytes(SECRET)
    (root / SECRET_FILE_NAME).chmod(0o600)
    alice, bob = make_tenant(SECRET, "alice"), make_tenant(SECRET, "bob")
    runner = make_runner(root, clock=Clock(1000.0))
    run(runner, alice, [msg("system", SYSTEM), msg("user", "Where is parcel 4217?")], session="T")
    run(runner, alice, [msg("system", SYSTEM), msg("user", image_part(alice, picture(2)), "Read it.")], session="S")
    run(runner, bob, [msg("system", SYSTEM), msg("user", "Where is parcel 4217?")], session="T")
    runner.close()
    return root


@pytest.fixture
def cache_dir(template: Path, tmp_path: Path) -> Path:
    target = tmp_path / "state"
    shutil.copytree(template, target)
    (tmp_path / "keys.toml").write_text(KEYS)
    return target


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict | str, str]:
    code = main(["cache", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if "--json" in args and out.strip() else out), err


def rows(cache_dir: Path) -> list:
    (name,) = [p.name for p in (cache_dir / "ssd").iterdir()]
    index = SsdIndex(SsdLayout(cache_dir, name).index_path)
    try:
        return list(index.rows())
    finally:
        index.close()


def ns(tenant_id: str) -> str:
    return make_tenant(SECRET, tenant_id).namespace


def test_stats_per_tenant_namespace(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, result, err = cli(capsys, "stats", "--cache-dir", str(cache_dir), "--keys",
                            str(cache_dir.parent / "keys.toml"), "--json")
    assert code == 0
    (model,) = result["models"].values()
    expected = {}
    for row in rows(cache_dir):
        e = expected.setdefault(row.namespace, {"kv": 0, "vision": 0, "bytes": 0})
        e[row.kind.value] += 1
        e["bytes"] += row.size if row.kind is RecordKind.KV else 0
    assert set(model) == {ns("alice"), ns("bob")}
    for namespace, e in expected.items():
        assert (model[namespace]["kv_records"], model[namespace]["vision_records"]) == (e["kv"], e["vision"])
        assert model[namespace]["kv_bytes"] == model[namespace]["kv_bytes_on_disk"] == e["bytes"]
    assert (model[ns("alice")]["tenant"], model[ns("alice")]["sessions"]) == ("alice", 2)
    assert model[ns("bob")]["vision_records"] == 0
    assert "[" in err  # the progress bar went to stderr
    code, text, _ = cli(capsys, "stats", "--cache-dir", str(cache_dir), "--tenant", "bob")
    assert code == 0 and ns("bob") in text and ns("alice") not in text


def test_tools_refuse_while_a_server_holds_the_lock(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runner = make_runner(cache_dir)
    try:
        for command in ("stats", "verify", "gc"):
            code, _, err = cli(capsys, command, "--cache-dir", str(cache_dir))
            assert code == 2 and "a running server holds the SSD tier lock" in err
    finally:
        runner.close()
    assert cli(capsys, "stats", "--cache-dir", str(cache_dir))[0] == 0


def test_verify_finds_and_quarantines_a_corrupt_file(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, result, _ = cli(capsys, "verify", "--cache-dir", str(cache_dir), "--json")
    (model,) = result["models"].values()
    assert code == 0 and model["files"] == model["ok"] == len(rows(cache_dir)) and model["findings"] == []
    victim = sorted((cache_dir / "kv").rglob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x10
    victim.write_bytes(bytes(data))
    code, result, _ = cli(capsys, "verify", "--cache-dir", str(cache_dir), "--json")
    (model,) = result["models"].values()
    assert code == 1
    assert [(f["verdict"], f["path"], f["action"]) for f in model["findings"]] == [("corrupt", str(victim), None)]
    code, result, _ = cli(capsys, "verify", "--cache-dir", str(cache_dir), "--quarantine", "--json")
    assert code == 1 and list(result["models"].values())[0]["findings"][0]["action"] == "quarantined"
    assert not victim.exists()
    assert [p.name.split("-")[:3] for p in (cache_dir / "quarantine").iterdir()] == [
        ["kv", victim.name.split(".")[0], victim.parent.parent.parent.name]]
    assert bytes.fromhex(victim.name.split(".")[0]) not in {row.key for row in rows(cache_dir)}
    assert cli(capsys, "verify", "--cache-dir", str(cache_dir))[0] == 0


def test_gc_applies_retention_quotas_and_budget(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tree = next((cache_dir / "kv").iterdir())
    stray = tree / ns("bob") / ".leftover.safetensors.123.ab.tmp"
    stray.write_bytes(b"partial")
    before = rows(cache_dir)
    code, result, _ = cli(capsys, "gc", "--cache-dir", str(cache_dir), "--keys",
                          str(cache_dir.parent / "keys.toml"), "--json")
    assert code == 0
    (model,) = result["models"].values()
    alice_rows = [r for r in before if r.namespace == ns("alice")]
    bob_rows = [r for r in before if r.namespace == ns("bob")]
    assert model["temp_files_removed"] == 1 and not stray.exists()
    # alice: stored in 1970, retention one hour: all expired. bob: a 1-byte quota keeps nothing.
    assert model["expired"]["kv"]["count"] == sum(r.kind is RecordKind.KV for r in alice_rows)
    assert model["expired"]["vision"]["count"] == 1
    assert model["over_quota"]["kv"]["count"] == len(bob_rows)
    assert rows(cache_dir) == []
    assert list((cache_dir / "kv").rglob("*.safetensors")) == []


def test_gc_budget_keeps_the_most_recently_used(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = sorted(rows(cache_dir), key=lambda r: (r.last_access, r.kind.value, r.key))
    keep = before[-2:]
    budget = sum(r.size for r in keep)
    code, result, _ = cli(capsys, "gc", "--cache-dir", str(cache_dir), "--ssd-budget", str(budget), "--json")
    assert code == 0
    assert sorted(r.key for r in rows(cache_dir)) == sorted(r.key for r in keep)


def test_erase_a_session_then_a_tenant(cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = str(cache_dir.parent / "keys.toml")
    before = rows(cache_dir)
    only_s = {r.key for r in before if r.namespace == ns("alice") and r.owners == ("S",)}
    shared = {r.key for r in before if r.namespace == ns("alice") and set(r.owners) == {"S", "T"}}
    assert only_s and shared
    code, result, _ = cli(capsys, "erase", "--cache-dir", str(cache_dir), "--tenant", "alice",
                          "--session", "S", "--keys", keys, "--json")
    assert code == 0
    (model,) = result["models"].values()
    assert model["deleted"]["kv"]["count"] + model["deleted"]["vision"]["count"] == len(only_s)
    assert model["kept_shared"] == len(shared)
    after = {r.key: r.owners for r in rows(cache_dir)}
    assert not only_s & set(after) and all(after[k] == ("T",) for k in shared)
    for key in only_s:
        assert not list(cache_dir.rglob(f"{key.hex()}*"))

    assert cli(capsys, "erase", "--cache-dir", str(cache_dir), "--tenant", "carol", "--keys", keys)[0] == 2
    code, text, _ = cli(capsys, "erase", "--cache-dir", str(cache_dir), "--tenant", "bob")
    assert code == 0 and "erased tenant bob" in text
    assert {r.namespace for r in rows(cache_dir)} == {ns("alice")}
    assert not (next((cache_dir / "kv").iterdir()) / ns("bob")).exists()
