"""``vlmcache serve`` as a real process: flags reach the server, SIGTERM stops it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from openai import OpenAI

from tests.server.helpers import image_message, png_data_url, wait_until_healthy

STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_command_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = _free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "serve", "--fixture", "qwen2_vl",
             "--fixture-preset", "tiny", "--port", str(port), "--cache-dir", str(tmp_path / "state"),
             "--model-name", "tiny-cli", "--block-size", "32"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "VLMCACHE_MAX_IMAGES": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, base, log_path, STARTUP_TIMEOUT_S)
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny-cli", max_tokens=2,
            messages=[image_message("hello", png_data_url((16, 16)))])
        assert reply.model == "tiny-cli"
        # VLMCACHE_MAX_IMAGES=1 from the environment reached the server.
        two = httpx.post(base + "/v1/chat/completions", timeout=30, json={
            "model": "tiny-cli", "max_tokens": 1,
            "messages": [image_message("a", png_data_url((8, 8))), image_message("b", png_data_url((8, 8)))]})
        assert two.status_code == 400 and two.json()["error"]["code"] == "too_many_images"
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    output = log_path.read_text()
    # uvicorn shuts the app down (lifespan: engine thread joined), then re-raises the signal.
    assert code in (0, -signal.SIGTERM), output
    assert "Application shutdown complete." in output
    assert "AUTHENTICATION IS OFF" in output
    assert (tmp_path / "state" / "server_secret").stat().st_mode & 0o777 == 0o600
