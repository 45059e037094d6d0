"""Restart survival: process A serves a 4-turn image conversation and exits; process B on the
same cache directory answers turn 5 from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def serve_process(family: str, cache_dir: Path, state: Path, turns: int, *, cold: bool = False) -> dict[str, Any]:
    """Run one server lifetime (``tests.ssd.conversation_process``) to completion."""
    command = [
        sys.executable, "-m", "tests.ssd.conversation_process", "--family", family,
        "--cache-dir", str(cache_dir), "--turns", str(turns), "--state", str(state),
    ]
    if cold:
        command.append("--cold")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(state.read_text())["processes"][-1]


def test_second_process_answers_turn_5_from_disk(family: str, tmp_path: Path) -> None:
    cache, state = tmp_path / "cache", tmp_path / "state.json"
    first = serve_process(family, cache, state, turns=4)
    assert [turn["turn"] for turn in first["turns"]] == [0, 1, 2, 3]
    assert first["turns"][0]["encoder_runs"] == 1
    # Closing wrote the resident blocks (RAM was never full) and the image's features.
    assert len(list((cache / "kv").rglob("*.safetensors"))) > 0
    assert len(list((cache / "vision").rglob("*.safetensors"))) == 1

    second = serve_process(family, cache, state, turns=5, cold=True)
    assert second["resident_blocks_at_start"] == 0  # nothing in RAM: a new process
    (turn5,) = second["turns"]
    assert turn5["turn"] == 4
    assert turn5["cached_tokens"] > 0
    assert turn5["encoder_runs"] == 0  # the turn-1 image is never encoded again
    assert turn5["tokens"] == second["cold_tokens"]
    ssd = second["ssd"]
    assert ssd["reads"] > 0 and ssd["promotions"] > 0 and ssd["hits"] == 1
    assert ssd["quarantined"] == 0 and ssd["reconcile_removed"] == 0
