"""Restart survival through the real server: ``vlmcache serve`` answers four turns of an image
conversation and is stopped with SIGTERM; a new server on the same cache directory answers
turn 5 from disk, as a server on an empty directory would, without encoding the image again."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from fixtures.conversation import load_conversation, openai_messages
from tests.server.helpers import wait_until_healthy

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
MODEL = "tiny-restart"


@contextmanager
def serving(cache_dir: Path, log_path: Path) -> Iterator[str]:
    """A ``vlmcache serve`` process on the tiny qwen2_vl fixture; yields its base URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--fixture", "qwen2_vl",
             "--fixture-preset", "tiny", "--port", str(port), "--cache-dir", str(cache_dir),
             "--model-name", MODEL, "--block-size", "16"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, base, log_path, STARTUP_TIMEOUT_S)
        yield base
    finally:
        process.send_signal(signal.SIGTERM)  # graceful: the engine closes, flushing to SSD
        code = process.wait(60)
        assert code in (0, -signal.SIGTERM), log_path.read_text()


def ask(base: str, turn: int) -> Any:
    session = load_conversation("one_image_10_turns").sessions[0]
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=openai_messages(session, turn))


def test_restarted_server_answers_turn_5_from_disk(tmp_path: Path) -> None:
    state, log = tmp_path / "state", tmp_path / "serve.log"
    with serving(state, log) as base:
        for turn in range(4):
            ask(base, turn)
    with serving(state, log) as base:
        warm = ask(base, 4)
        stats = httpx.get(base + "/v1/cache/stats", timeout=30).json()["stats"]
    with serving(tmp_path / "empty", log) as base:
        cold = ask(base, 4)
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.choices[0].message.content == cold.choices[0].message.content
    assert stats["encoder_runs"] == 0
    assert stats["ssd"]["promotions"] > 0 and stats["ssd"]["reads"] > 0
