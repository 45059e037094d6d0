"""Small factories shared by the server tests: images, requests, envelopes."""

from __future__ import annotations

import base64
import io
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from PIL import Image


def png_bytes(size: tuple[int, int] = (32, 32), color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    """A solid-colour PNG made with Pillow."""
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode("ascii")


def png_data_url(size: tuple[int, int] = (32, 32), color: tuple[int, int, int] = (200, 30, 30)) -> str:
    return data_url(png_bytes(size, color))


def image_message(text: str, url: str) -> dict[str, Any]:
    """A user message with one text part and one image part."""
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        {"type": "image_url", "image_url": {"url": url}}]}


def assert_envelope(body: Any, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """Check OpenAI's error envelope shape exactly and return the inner error object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


def wait_until_healthy(process: subprocess.Popen[bytes], base_url: str, log_path: Path,
                       timeout_s: float = 120.0) -> None:
    """Wait for a ``vlmcache serve`` subprocess to answer ``/health``; fail with its log if it
    exits or does not come up in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, log_path.read_text()
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
