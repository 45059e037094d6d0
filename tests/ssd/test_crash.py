"""Crash safety: a process spilling blocks is killed with SIGKILL at random moments; every
restart reconciles, and nothing partial or corrupt is ever indexed or served.

Two writers are killed: a bare tier spilling large synthetic blocks (every stored file is
checked byte for byte against what it must hold), and a serving engine on a tiny RAM budget
(the next request's output must equal a cold run).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures.conversation import load_conversation
from kv_cache.tiers.ssd_index import RecordKind
from server.engine.prompt import ReplyLedger
from tests.engine.conftest import run, session_messages, tenant
from tests.ssd.factories import make_runner, open_tier, same_payload, temp_files
from tests.ssd.spill_process import BUDGET, crash_payload, crash_tokens

REPO = Path(__file__).resolve().parents[2]


def kill_during_spills(cache_dir: Path, first_seed: int, delay_s: float) -> dict[str, int]:
    """Start a spilling process, SIGKILL it ``delay_s`` after it is ready; its reconcile report."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.ssd.spill_process", "--cache-dir", str(cache_dir),
         "--first-seed", str(first_seed)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = process.stdout.readline()
        assert line, process.stderr.read()[-4000:]
        report = json.loads(line)
        time.sleep(delay_s)
        assert process.poll() is None, process.stderr.read()[-4000:]
        process.send_signal(signal.SIGKILL)
        assert process.wait(30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        process.stdout.close()
        process.stderr.close()
    return report


def check_everything_stored_is_whole(cache_dir: Path) -> tuple[int, dict[str, int]]:
    """Open the tier (reconciling), then read back every indexed block and compare it with
    what its seed says it must hold. Returns the number of blocks and the reconcile report."""
    tier = open_tier(cache_dir, budget_bytes=BUDGET)
    try:
        assert temp_files(cache_dir) == []
        rows = tier.rows(RecordKind.KV)
        metas = tier.find_blocks([row.key for row in rows])
        assert len(metas) == len(rows)
        for meta in metas.values():
            seed = meta.tokens[0] // 8
            assert list(meta.tokens) == crash_tokens(seed)
            loaded = tier.load_block(meta)
            assert loaded is not None, f"indexed block {seed} did not verify"
            assert same_payload(loaded, crash_payload(seed))
        stats = tier.stats()
        assert stats.quarantined == 0 and stats.bytes <= BUDGET
        files = list((cache_dir / "kv").rglob("*.safetensors"))
        assert len(files) == len(rows)  # every file indexed, every row a file
        report = {
            "temp_removed": stats.reconcile_temp_removed,
            "adopted": stats.reconcile_adopted,
            "rows_dropped": stats.reconcile_rows_dropped,
            "removed": stats.reconcile_removed,
        }
        return len(rows), report
    finally:
        tier.close()


def crash_loop(cache_dir: Path, kills: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    totals = {"temp_removed": 0, "adopted": 0, "rows_dropped": 0, "removed": 0, "blocks": 0}
    for kill in range(kills):
        kill_during_spills(cache_dir, first_seed=kill * 10_000, delay_s=rng.uniform(0.05, 0.6))
        blocks, report = check_everything_stored_is_whole(cache_dir)
        totals["blocks"] = blocks
        for name, value in report.items():
            totals[name] += value
    return totals


def test_sigkill_during_spills_few_times(tmp_path: Path) -> None:
    totals = crash_loop(tmp_path, kills=3, seed=1)
    assert totals["blocks"] > 0
    assert totals["removed"] == 0  # a complete file is never invalid, a partial one never named


@pytest.mark.slow
def test_sigkill_during_spills_30_times(tmp_path: Path) -> None:
    totals = crash_loop(tmp_path, kills=30, seed=2)
    print("crash loop totals:", totals)
    assert totals["blocks"] > 0
    assert totals["removed"] == 0


def kill_engine(family: str, cache_dir: Path, delay_s: float) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.ssd.engine_spill_process", "--family", family,
         "--cache-dir", str(cache_dir)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout.readline() == "ready\n", process.stderr.read()[-4000:]
        time.sleep(delay_s)
        assert process.poll() is None, process.stderr.read()[-4000:]
        process.send_signal(signal.SIGKILL)
        assert process.wait(30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)
        process.stdout.close()
        process.stderr.close()


@pytest.mark.slow
def test_sigkill_of_a_serving_engine_never_serves_a_bad_block(family: str, tmp_path: Path) -> None:
    session = load_conversation("one_image_10_turns").sessions[0]
    t = tenant()
    cold = make_runner(family, None, ledger=ReplyLedger())
    replies: list[str] = []
    for turn in range(3):
        replies.append(run(cold, t, session_messages(t, session, turn, replies), max_tokens=10).text)
    messages = session_messages(t, session, 3, replies)
    expected = run(make_runner(family, None, ledger=ReplyLedger()), t, messages, max_tokens=10).tokens
    rng = random.Random(3)
    reused = []
    for _ in range(5):
        kill_engine(family, tmp_path, rng.uniform(0.2, 1.5))
        runner = make_runner(family, tmp_path, ledger=ReplyLedger())
        assert temp_files(tmp_path) == []
        warm = run(runner, t, messages, max_tokens=10)
        assert warm.tokens == expected
        assert runner.ssd.stats().quarantined == 0
        reused.append(warm.usage.cached_tokens)
        runner.close()
    assert max(reused) > 0, reused
