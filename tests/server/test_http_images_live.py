"""``--allow-http-images``: downloads from a local origin, with size limits and safe redirects."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer, make_config, running_server
from tests.server.helpers import assert_envelope, data_url, image_message, png_bytes

MAX_IMAGE_BYTES = 16 * 1024
PICTURE = png_bytes((30, 30), (0, 120, 240))


class _Origin(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict[str, str], bytes]] = {
        "/picture.png": (200, {"Content-Type": "image/png"}, PICTURE),
        "/to-picture": (302, {"Location": "/picture.png"}, b""),
        "/to-file": (302, {"Location": "file:///etc/passwd"}, b""),
        "/missing.png": (404, {}, b"no"),
        "/text": (200, {"Content-Type": "text/plain"}, b"hello, not an image"),
        "/huge.png": (200, {"Content-Type": "image/png"}, b"\x89PNG" + b"\0" * MAX_IMAGE_BYTES),
    }

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Origin)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    config = make_config(tiny_model_path, tmp_path_factory.mktemp("state"), allow_http_images=True,
                         max_image_bytes=MAX_IMAGE_BYTES, http_image_timeout_s=5.0)
    with running_server(config) as live:
        yield live


def _ask(server: LiveServer, url: str) -> dict:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={
            "model": server.model, "max_tokens": 2, "temperature": 0,
            "messages": [image_message("Describe the picture.", url)]})
    return {"status": response.status_code, "body": response.json()}


def test_http_image_is_fetched_and_keyed_by_pixels(server: LiveServer, origin: str) -> None:
    by_url = _ask(server, origin + "/picture.png")
    assert by_url["status"] == 200, by_url
    # The same pixels sent inline hash the same: the whole prompt prefix is reused.
    inline = _ask(server, data_url(PICTURE))
    assert inline["status"] == 200
    assert inline["body"]["usage"]["prompt_tokens"] == by_url["body"]["usage"]["prompt_tokens"]
    reused = inline["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
    other = _ask(server, data_url(png_bytes((30, 30), (240, 120, 0))))
    assert other["status"] == 200
    # A different picture at the same position reuses only the text before the image.
    assert other["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] < reused


def test_redirect_to_http_is_followed(server: LiveServer, origin: str) -> None:
    assert _ask(server, origin + "/to-picture")["status"] == 200


@pytest.mark.parametrize(("path", "code"), [
    ("/to-file", "image_fetch_failed"),
    ("/missing.png", "image_fetch_failed"),
    ("/huge.png", "image_fetch_failed"),
    ("/text", "invalid_image"),
])
def test_bad_http_images_are_400(server: LiveServer, origin: str, path: str, code: str) -> None:
    result = _ask(server, origin + path)
    assert result["status"] == 400, result
    assert_envelope(result["body"], code=code, param="messages[0].content[1].image_url")
    assert _ask(server, origin + "/picture.png")["status"] == 200
